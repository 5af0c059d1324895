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


# ---------------------------------------------------------------------------------------------
# FP4 mode 3 of the Triton MoE kernels: its PTX (`_FP4X8_SCALED_ASM`) emulated instruction by
# instruction from the string the kernels use, against the e2m1 table times 2**(u - 127)
# ---------------------------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of {b, a}, or,
    with bit 3 of that selector nibble set, that byte's msb replicated over 8 bits."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _bf16_value(bits: int) -> float:
    """A bf16 bit pattern's value (normal or subnormal; no inf/nan in these inputs)."""
    sign = -1.0 if bits & 0x8000 else 1.0
    e, m = (bits >> 7) & 0xFF, bits & 0x7F
    if e == 0:
        return sign * m * 2.0**-133  # 2**-126 * m / 128
    return sign * (1 + m / 128) * 2.0 ** (e - 127)


def _run_fp4x8_asm(asm: str, word: int, pair: int) -> list[float]:
    """Execute the PTX of `_FP4X8_SCALED_ASM` on one word and one scale pair: and/shr/prmt/
    mul.lo/mul.rn.bf16x2/mov of 32-bit registers. The bf16 multiply is exact here (a power-of-two
    scale times a value with <= 2 significant bits, in range), so it is emulated in float64.
    Returns the 8 outputs $0..$7 as values."""
    import re

    regs: dict[str, int] = {"$8": word & 0xFFFFFFFF, "$9": pair & 0xFFFFFFFF}
    outs: dict[int, float] = {}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 16) if tok.startswith("0x") else (regs[tok] if tok in regs else int(tok))

    for line in asm.strip().splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32":
            m = re.match(r"\{\$(\d+), \$(\d+)\}, (\w+)", rest)
            v = regs[m.group(3)]
            outs[int(m.group(1))] = _bf16_value(v & 0xFFFF)
            outs[int(m.group(2))] = _bf16_value(v >> 16)
            continue
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [val(a) for a in args[1:]]
        if op == "and.b32":
            regs[d] = srcs[0] & srcs[1]
        elif op == "shr.u32":
            regs[d] = srcs[0] >> srcs[1]
        elif op == "prmt.b32":
            regs[d] = _prmt(*srcs)
        elif op == "mul.lo.u32":
            regs[d] = (srcs[0] * srcs[1]) & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":
            lanes = []
            for sh in (0, 16):
                prod = _bf16_value((srcs[0] >> sh) & 0xFFFF) * _bf16_value((srcs[1] >> sh) & 0xFFFF)
                lanes.append(prod)
            regs[d] = _pack_exact(lanes)
        else:
            raise AssertionError(f"unexpected PTX op {op!r}")
    return [outs[k] for k in range(8)]


def _pack_exact(lanes: list[float]) -> int:
    """Two exactly representable bf16 values (normal, or zero) -> their packed bits."""
    out = 0
    for i, v in enumerate(lanes):
        bits = 0x8000 if math.copysign(1.0, v) < 0 else 0
        a = abs(v)
        if a != 0.0:
            e = math.floor(math.log2(a))
            m = a / 2.0**e - 1.0
            assert m * 128 == int(m * 128), "not a bf16 value"
            bits |= ((e + 127) << 7) | int(m * 128)
        out |= bits << (16 * i)
    return out


@settings(max_examples=60, deadline=None)
@given(word=st.integers(0, 2**32 - 1), u=st.integers(100, 128))
def test_fp4_mode3_ptx_against_e2m1_table(word, u):
    """Mode 3's PTX, run instruction by instruction, gives value k = e2m1(nibble k) * 2**(u-127)
    in output k, signs (and -0) included, for the scale pair the kernel builds."""
    pytest.importorskip("triton")
    from deepinfer_kernels.triton import moe as tmoe

    pair = ((u + 126) << 7) * 65537  # as `_fp4_words_scaled` builds it
    got = _run_fp4x8_asm(str(tmoe._FP4X8_SCALED_ASM.value), word, pair)
    for k in range(8):
        nib = (word >> (4 * k)) & 0xF
        want = E2M1[nib & 7] * 2.0 ** (u - 127) * (-1.0 if nib & 8 else 1.0)
        assert got[k] == want and math.copysign(1.0, got[k]) == math.copysign(1.0, want), (k, nib)


def test_moe_config_rejects_unknown_fp4_mode():
    pytest.importorskip("triton")
    from deepinfer_kernels.triton import moe as tmoe

    with pytest.raises(ValueError, match="fp4_mode"):
        tmoe.MoeConfig(16, 64, 64, 4, 4, 4, fp4_mode=4)
    assert tmoe.MoeConfig(16, 64, 64, 4, 4, 4, fp4_mode=3).fp4_mode == 3


def test_moe_fragment_weights_need_words_and_128_wide_dims():
    """Fragment-order weights (`quant.fp4_fragment_order`) are read as FP4 words in K steps of 64
    or 128; D and I must be multiples of 128. Anything else is a ValueError naming it, raised
    before any kernel runs."""
    pytest.importorskip("triton")
    from dataclasses import replace

    from deepinfer_kernels.triton import moe as tmoe

    with pytest.raises(ValueError, match="fragment_weights needs fp4_mode=2"):
        tmoe.MoeConfig(16, 64, 64, 4, 4, 4, block_k=128, fp4_mode=3, fragment_weights=True)
    with pytest.raises(ValueError, match="block_k=32"):
        tmoe.MoeConfig(16, 64, 64, 4, 4, 4, block_k=32, fp4_mode=2, fragment_weights=True)
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
