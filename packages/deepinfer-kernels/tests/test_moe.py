"""ops.moe_gate / ops.moe_experts (ref tier on CPU) against float64 math written in the test."""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer_kernels import ops, quant
from f64_math import E4M3, quant_group
from hypothesis import given, settings
from hypothesis import strategies as st


def _gate_f64(x, weight, bias, topk, route_scale, gate_temp):
    """Plain loops: scores, choice by score + bias, normalised weights."""
    ids_all, w_all = [], []
    for row in x.double().tolist():
        s = []
        for wrow in weight.double().tolist():
            logit = sum(a * b for a, b in zip(row, wrow, strict=True)) / gate_temp
            s.append(math.sqrt(math.log1p(math.exp(logit))))
        b = bias.double().tolist() if bias is not None else [0.0] * len(s)
        order = sorted(range(len(s)), key=lambda e: -(s[e] + b[e]))[:topk]
        total = sum(s[e] for e in order)
        ids_all.append(order)
        w_all.append([s[e] / (total + 1e-20) * route_scale for e in order])
    return ids_all, w_all


@settings(max_examples=10, deadline=None)
@given(t=st.integers(1, 7), e=st.integers(4, 12), seed=st.integers(0, 2**31))
def test_moe_gate_against_float64(t, e, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 64, generator=gen)
    weight = torch.randn(e, 64, generator=gen) * 0.3
    bias = torch.randn(e, generator=gen)
    k = min(3, e)
    w, ids = ops.moe_gate(x, weight, bias, k, 1.5, gate_temp=1.3)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and tuple(ids.shape) == (t, k)
    want_ids, want_w = _gate_f64(x, weight, bias, k, 1.5, 1.3)
    assert ids.tolist() == want_ids
    assert torch.allclose(w.double(), torch.tensor(want_w, dtype=torch.float64), rtol=1e-5)


def test_moe_gate_per_token_bias_and_no_bias():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=gen).bfloat16()
    weight = torch.randn(8, 32, generator=gen).bfloat16()
    bias = torch.randn(4, 8, generator=gen)
    w, ids = ops.moe_gate(x, weight, bias, 2, 1.0)
    for i in range(4):
        want_ids, want_w = _gate_f64(x[i : i + 1], weight, bias[i], 2, 1.0, 1.0)
        assert ids[i].tolist() == want_ids[0]
        assert w[i].double().tolist() == pytest.approx(want_w[0], rel=1e-5)
    w, ids = ops.moe_gate(x, weight, None, 8, 2.0)
    assert torch.allclose(w.sum(-1), torch.full((4,), 2.0))


def test_moe_gate_bad_arguments():
    x, weight = torch.randn(2, 32), torch.randn(8, 32)
    with pytest.raises(ValueError, match=r"topk must be in 1\.\.8"):
        ops.moe_gate(x, weight, None, 9, 1.0)
    with pytest.raises(ValueError, match="bias must be"):
        ops.moe_gate(x, weight, torch.zeros(7), 2, 1.0)
    with pytest.raises(ValueError, match="weight must be"):
        ops.moe_gate(x, torch.randn(8, 16), None, 2, 1.0)


def _round(v: float, dtype: torch.dtype) -> float:
    return torch.tensor(v, dtype=torch.float64).to(dtype).double().item()


def _qrow(row: list[float]) -> list[float]:
    out = []
    for g in range(0, len(row), 32):
        out += quant_group(row[g : g + 32], 448.0, E4M3, 1e-4)
    return out


def _matvec(w: list[list[float]], v: list[float]) -> list[float]:
    return [sum(a * b for a, b in zip(wr, v, strict=True)) for wr in w]


def _experts_f64(x, tw, ids, w1, s1, w3, s3, w2, s2, limit):
    """Per (token, slot): quantise, W1/W3, clamp, SwiGLU x weight, quantise, W2; summed."""
    dt = x.dtype
    wd = {
        name: quant.dequantize_fp4(p, s, torch.float64)
        for name, p, s in (("w1", w1, s1), ("w3", w3, s3), ("w2", w2, s2))
    }
    out = []
    for t, row in enumerate(x.double().tolist()):
        acc = [0.0] * len(row)
        xq = _qrow(row)
        for slot in sorted(range(ids.shape[1]), key=lambda j: ids[t, j].item()):
            e = ids[t, slot].item()
            if e < 0:
                continue
            g = [_round(v, dt) for v in _matvec(wd["w1"][e].tolist(), xq)]
            u = [_round(v, dt) for v in _matvec(wd["w3"][e].tolist(), xq)]
            if limit > 0:
                g = [min(v, limit) for v in g]
                u = [max(-limit, min(limit, v)) for v in u]
            wt = tw[t, slot].item()
            h = [_round(wt * (b * a / (1 + math.exp(-a))), dt) for a, b in zip(g, u, strict=True)]
            y = [_round(v, dt) for v in _matvec(wd["w2"][e].tolist(), _qrow(h))]
            acc = [a + b for a, b in zip(acc, y, strict=True)]
        out.append(acc)
    return torch.tensor(out, dtype=torch.float64)


def _experts(e, d, i, gen, scale=0.1):
    def q(n, k):
        return quant.quantize_fp4_experts(torch.randn(e, n, k, generator=gen) * scale)

    (w1, s1), (w3, s3), (w2, s2) = q(i, d), q(i, d), q(d, i)
    return w1, s1, w3, s3, w2, s2


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_moe_experts_against_float64(dtype, tol, limit):
    gen = torch.Generator().manual_seed(11)
    t, d, i, e, k = 6, 64, 64, 5, 2
    x = (torch.randn(t, d, generator=gen) * 2).to(dtype)
    ws = _experts(e, d, i, gen)
    ids = torch.tensor([[0, 3], [3, 0], [1, 4], [4, -1], [0, 1], [3, 4]])  # expert 2: no tokens
    tw = torch.rand(t, k, generator=gen)
    got = ops.moe_experts(x, tw, ids, *ws, limit)
    assert got.dtype == dtype and tuple(got.shape) == (t, d)
    assert _rel(got, _experts_f64(x, tw, ids, *ws, limit)) < tol


def test_moe_experts_clamp_is_active():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 64, generator=gen) * 4
    ws = _experts(2, 64, 32, gen, scale=1.0)
    ids, tw = torch.tensor([[0, 1]] * 3), torch.ones(3, 2)
    clamped = ops.moe_experts(x, tw, ids, *ws, 1.0)
    free = ops.moe_experts(x, tw, ids, *ws, 0.0)
    assert not torch.allclose(clamped, free)
    assert _rel(clamped, _experts_f64(x, tw, ids, *ws, 1.0)) < 1e-4


def test_moe_experts_batch_invariant_bitwise(batch_invariant):
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    ws = _experts(4, 64, 64, gen)
    ids = torch.randint(0, 4, (9, 2), generator=gen)
    ids[:, 1] = (ids[:, 0] + 1) % 4
    tw = torch.rand(9, 2, generator=gen)
    full = ops.moe_experts(x, tw, ids, *ws, 10.0)
    for r in (0, 4, 8):
        one = ops.moe_experts(x[r : r + 1], tw[r : r + 1], ids[r : r + 1], *ws, 10.0)
        assert torch.equal(one[0], full[r])


def test_moe_experts_bad_arguments():
    gen = torch.Generator().manual_seed(14)
    w1, s1, w3, s3, w2, s2 = _experts(2, 64, 32, gen)
    x, ids, tw = torch.randn(2, 64), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(ValueError, match="w2 must be"):
        ops.moe_experts(x, tw, ids, w1, s1, w3, s3, w2[:, :32], s2, 1.0)
    with pytest.raises(ValueError, match="s1 must be"):
        ops.moe_experts(x, tw, ids, w1, s1[:, :, :1], w3, s3, w2, s2, 1.0)
    with pytest.raises(ValueError, match="topk_weights must be"):
        ops.moe_experts(x, tw[:, :0], ids, w1, s1, w3, s3, w2, s2, 1.0)
    with pytest.raises(ValueError, match="topk_ids must be < E=2"):
        ops.moe_experts(x, tw, ids + 2, w1, s1, w3, s3, w2, s2, 1.0)


def test_moe_config_rejects_bad_k_steps():
    pytest.importorskip("triton")
    from deepinfer_kernels.triton import moe as tmoe

    with pytest.raises(ValueError, match="K steps must be positive multiples of 32"):
        tmoe.MoeConfig(16, 64, 64, 4, 4, 4, block_k=48)
    assert tmoe.MoeConfig(16, 64, 64, 4, 4, 4, block_k=256).block_k == 256


def test_moe_fragment_weights_need_words_and_128_wide_dims():
    """Fragment-order weights (`quant.fp4_fragment_order`) are read in K steps of 64 or 128; D and
    I must be multiples of 128. Anything else is a ValueError naming it, raised before any kernel
    runs."""
    pytest.importorskip("triton")
    from dataclasses import replace

    from deepinfer_kernels.triton import moe as tmoe

    with pytest.raises(ValueError, match="fragment_weights needs K steps of 64 or 128"):
        tmoe.MoeConfig(16, 64, 64, 4, 4, 4, block_k=256, fragment_weights=True)
    with pytest.raises(ValueError, match="block_k=32"):
        tmoe.MoeConfig(16, 64, 64, 4, 4, 4, block_k=32, fragment_weights=True)
    cfg = replace(tmoe.PREFILL, fragment_weights=True)
    e, d, i = 4, 192, 128  # D = 192: not a multiple of 128
    w = torch.zeros(e, i, d // 2, dtype=torch.int8)
    s = torch.zeros(e, i, d // 32, dtype=torch.float8_e8m0fnu)
    w2 = torch.zeros(e, d, i // 2, dtype=torch.int8)
    s2 = torch.zeros(e, d, i // 32, dtype=torch.float8_e8m0fnu)
    ids = torch.zeros(2, 1, dtype=torch.int64)
    x = torch.zeros(2, d, dtype=torch.bfloat16)
    args = (x, ids.float(), ids, w, s, w, s, w2, s2, 10.0)
    with pytest.raises(ValueError, match="multiples of 128, got D=192"):
        tmoe.moe_experts(*args, config=cfg, fragment_order=True)
    with pytest.raises(ValueError, match="fragment_weights=True but fragment_order=False"):
        tmoe.moe_experts(*args, config=cfg)


def test_moe_experts_on_fragment_order_weights():
    """`fragment_order=True` with the weights in `quant.fp4_fragment_order`: the same results
    (bitwise) as the checkpoint's order; D and I must be multiples of 128 (a ValueError)."""
    gen = torch.Generator().manual_seed(13)
    t, d, i, e, k = 5, 128, 256, 4, 2
    x = torch.randn(t, d, generator=gen).bfloat16()
    w1, s1, w3, s3, w2, s2 = _experts(e, d, i, gen)
    f = quant.fp4_fragment_order
    ids = torch.tensor([[0, 3], [3, 0], [1, -1], [0, 1], [3, 1]])
    tw = torch.rand(t, k, generator=gen)
    want = ops.moe_experts(x, tw, ids, w1, s1, w3, s3, w2, s2, 0.5)
    got = ops.moe_experts(x, tw, ids, f(w1), s1, f(w3), s3, f(w2), s2, 0.5, fragment_order=True)
    assert torch.equal(got, want)
    ws = _experts(e, 64, i, gen)
    with pytest.raises(ValueError, match="multiples of 128, got D=64, I=256"):
        ops.moe_experts(x[:, :64], tw, ids, *ws, 0.5, fragment_order=True)


def test_fragment_order_pays_only_in_invariant_mode_on_the_cuda_tier():
    """`ops.moe_fragment_order_pays` on CPU: never (the ref tier un-permutes), whatever the mode
    and dims. The GPU side (True in batch-invariant mode on Hopper) is in test_cuda_moe.py."""
    from deepinfer_kernels import REGISTRY

    for on in (False, True):
        with REGISTRY.batch_invariant_mode(on):
            assert not ops.moe_fragment_order_pays(5120, 2304, "cpu")
            assert not ops.moe_fragment_order_pays(5120, 2304, torch.device("cpu"))
