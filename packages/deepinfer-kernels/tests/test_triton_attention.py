"""The triton tier of `sparse_sink_attention` (`triton/attention.py`) on small shapes, against
float64 math written here and against the ref tier: T = 1 and odd, heads not a multiple of the
head block, K not a multiple of the key tile, rows with no valid index, repeated indices, int32
and int64 indices, fp32 and bf16; plus batch invariance and -1 padding, bit for bit.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU (set before it is defined); with CUDA
it runs compiled. The interpreter converts fp32 to bf16 by truncation (the GPU rounds to
nearest), so bf16 outputs are held to one bf16 step (2**-7 relative) plus a small absolute term;
that bound is tight enough to catch a kernel that rounds the probabilities to bf16 alone.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels import ops
from deepinfer_kernels.ref import attention as ref_attention
from hypothesis import example, given, settings
from hypothesis import strategies as st
from triton_tier import DEV, triton_module

ta = triton_module("attention")


def f64_attention(q, kv, indices, sink, scale) -> torch.Tensor:
    """The definition, one token at a time in float64: softmax over the valid indices (repeats
    count twice) with exp(sink_h) added to the denominator; no valid index gives 0."""
    t_n, h_n, d = q.shape
    out = torch.zeros(t_n, h_n, d, dtype=torch.float64)
    kvd, sd = kv.double().cpu(), sink.double().cpu()
    for t in range(t_n):
        sel = [int(i) for i in indices[t].tolist() if i >= 0]
        if not sel:
            continue
        keys = kvd[sel]  # [k, d]
        logits = (q[t].double().cpu() @ keys.T) * scale  # [H, k]
        m = torch.maximum(logits.max(dim=1).values, sd)
        e = torch.exp(logits - m[:, None])
        den = e.sum(dim=1) + torch.exp(sd - m)
        out[t] = (e @ keys) / den[:, None]
    return out


def _check_close(
    got: torch.Tensor, want: torch.Tensor, kv: torch.Tensor, logit_scale: float = 1.0
) -> None:
    """got within tolerance of want: fp32, fp32 rounding of the logits (whose size grows with
    logit_scale, e.g. scale * sqrt(d) for unit-normal q and keys: a sharp softmax passes more of
    it to the output); bf16, one bf16 step."""
    assert not torch.isnan(got).any(), "NaN in output"
    g = got.double().cpu()
    if got.dtype == torch.float32:
        tol = 1e-5 * want.abs() + 1e-6 * kv.abs().max().item() * max(1.0, logit_scale)
    else:  # one bf16 step of the output, plus fp32-accumulation noise
        tol = 2.0**-7 * want.abs() + 1e-5 * kv.abs().float().max().item()
    bad = (g - want).abs() > tol
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} outside tolerance; worst "
        f"{((g - want).abs() - tol).max().item():.3g}"
    )


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _case(t, h, d, n, k, dtype, seed, empty_rows=(), dup=False, idx_dtype=torch.int64):
    g = _gen(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    kv = torch.randn(n, d, generator=g).to(dtype)
    idx = torch.randint(-1, max(n, 1), (t, k), generator=g)
    if dup and k >= 2:  # the same kv row several times in one row's list
        idx[:, 1::3] = idx[:, :1]
    for r in empty_rows:
        idx[r] = -1
    sink = torch.randn(h, generator=g) * 2
    return q.to(DEV), kv.to(DEV), idx.to(idx_dtype).to(DEV), sink.to(DEV)


@st.composite
def _shapes(draw):
    t = draw(st.sampled_from([1, 2, 3, 5]))
    h = draw(st.sampled_from([1, 4, 16, 20, 33]))
    d = draw(st.sampled_from([16, 48, 64, 128]))
    n = draw(st.integers(1, 80))
    k = draw(st.sampled_from([1, 7, 33, 64, 65, 130]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    empty = draw(st.sets(st.integers(0, t - 1), max_size=2))
    dup = draw(st.booleans())
    idx_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    sharp = draw(st.sampled_from([1.0, 4.0]))  # scale multiplier: flat or peaked softmax
    seed = draw(st.integers(0, 2**31 - 1))
    return t, h, d, n, k, dtype, empty, dup, idx_dtype, sharp, seed


@settings(max_examples=30, deadline=None)
@given(_shapes())
@example((3, 20, 128, 61, 64, torch.float32, set(), False, torch.int64, 4.0, 0))  # sharp, fp32
def test_matches_float64_and_ref(case):
    t, h, d, n, k, dtype, empty, dup, idx_dtype, sharp, seed = case
    q, kv, idx, sink = _case(t, h, d, n, k, dtype, seed, empty, dup, idx_dtype)
    scale = sharp * d**-0.5
    got = ta.sparse_sink_attention(q, kv, idx, sink, scale)
    assert got.dtype == dtype and got.shape == (t, h, d)
    want = f64_attention(q, kv, idx, sink, scale)
    _check_close(got, want, kv, scale * d**0.5)
    if dtype == torch.float32:  # the ref tier's bf16 output rounds where the interpreter truncates
        ref = ref_attention.sparse_sink_attention(q, kv, idx, sink, scale)
        _check_close(got, ref.double().cpu(), kv, scale * d**0.5)
    for r in empty:
        assert torch.equal(got[r], torch.zeros_like(got[r]))


def test_v41_head_shape():
    # H 64, d 512: two 32-head blocks (interpreter: 16-head blocks are the same code path)
    q, kv, idx, sink = _case(3, 64, 512, 300, 200, torch.bfloat16, seed=7, empty_rows=(1,))
    got = ta.sparse_sink_attention(q, kv, idx, sink, 512**-0.5)
    _check_close(got, f64_attention(q, kv, idx, sink, 512**-0.5), kv)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_batch_invariant_bitwise():
    q, kv, idx, sink = _case(5, 20, 64, 60, 70, torch.bfloat16, seed=11, empty_rows=(2,))
    full = ta.sparse_sink_attention(q, kv, idx, sink, 0.125)
    for t in (0, 3, 4):
        alone = ta.sparse_sink_attention(q[t : t + 1], kv, idx[t : t + 1], sink, 0.125)
        assert torch.equal(alone[0], full[t])
    # other tokens' rows (and a longer pool) do not change a token's bits
    more_kv = torch.cat([kv, torch.randn(40, 64, generator=_gen(1)).to(kv)])
    swapped = torch.cat([idx[:1], torch.randint(0, 100, (4, 70), generator=_gen(2)).to(idx)])
    mixed = torch.cat([q[:1], q[1:].flip(0)])
    again = ta.sparse_sink_attention(mixed, more_kv, swapped, sink, 0.125)
    assert torch.equal(again[0], full[0])


def test_minus_one_padding_is_exact():
    q, kv, idx, sink = _case(3, 4, 64, 50, 70, torch.float32, seed=5)
    base = ta.sparse_sink_attention(q, kv, idx, sink, 0.2)
    pad = torch.full((3, 150), -1, dtype=idx.dtype, device=idx.device)
    padded = ta.sparse_sink_attention(q, kv, torch.cat([idx, pad], dim=1), sink, 0.2)
    assert torch.equal(base, padded)


def test_empty_cases_return_zeros():
    q, kv, idx, sink = _case(3, 4, 32, 10, 5, torch.bfloat16, seed=3, empty_rows=(0, 1, 2))
    assert torch.equal(ta.sparse_sink_attention(q, kv, idx, sink, 0.1), torch.zeros_like(q))
    no_k = idx[:, :0]
    assert torch.equal(ta.sparse_sink_attention(q, kv, no_k, sink, 0.1), torch.zeros_like(q))
    assert torch.equal(ta.sparse_sink_attention(q, kv[:0], idx, sink, 0.1), torch.zeros_like(q))
    assert ta.sparse_sink_attention(q[:0], kv, idx[:0], sink, 0.1).shape == (0, 4, 32)


def test_index_past_pool_is_skipped():
    q, kv, idx, sink = _case(2, 4, 32, 10, 9, torch.float32, seed=4)
    bad = idx.clone()
    bad[:, ::4] = 10 + torch.arange(bad[:, ::4].shape[1], device=idx.device)
    minus = torch.where(bad >= 10, -1, bad)
    assert torch.equal(
        ta.sparse_sink_attention(q, kv, bad, sink, 0.3),
        ta.sparse_sink_attention(q, kv, minus, sink, 0.3),
    )


def test_strided_inputs():
    g = _gen(9)
    big = torch.randn(3, 8, 64, generator=g).to(DEV)
    q = big[:, ::2]  # [3, 4, 64], head stride 128
    kv = torch.randn(40, 128, generator=g).to(DEV)[:, :64]  # row stride 128
    idx = torch.randint(-1, 40, (3, 50), generator=g).to(DEV)
    sink = torch.randn(4, generator=g).to(DEV)
    got = ta.sparse_sink_attention(q, kv, idx, sink, 0.125)
    _check_close(got, f64_attention(q, kv, idx, sink, 0.125), kv)


def test_op_validation_and_dispatch():
    q, kv, idx, sink = _case(2, 4, 32, 10, 5, torch.float32, seed=1)
    with pytest.raises(ValueError, match="kv must be"):
        ops.sparse_sink_attention(q, kv[:, :16], idx, sink, 0.1)
    with pytest.raises(ValueError, match="indices must be"):
        ops.sparse_sink_attention(q, kv, idx[:1], sink, 0.1)
    with pytest.raises(ValueError, match="indices must have dtype"):
        ops.sparse_sink_attention(q, kv, idx.float(), sink, 0.1)
    with pytest.raises(ValueError, match="sink must be"):
        ops.sparse_sink_attention(q, kv, idx, sink[:2], 0.1)
    with pytest.raises(ValueError, match="q must be"):
        ops.sparse_sink_attention(q[0], kv, idx, sink, 0.1)
    from deepinfer_kernels.ops.attention import triton_attention_reason

    assert triton_attention_reason(q.cpu(), kv.cpu()) == "input on cpu"
    if DEV == "cuda":
        assert "bfloat16" in triton_attention_reason(q, kv)  # fp32 stays on ref
        qb, kvb = q.bfloat16(), kv.bfloat16()
        assert triton_attention_reason(qb, kvb) is None
        assert "bfloat16" in triton_attention_reason(qb, kv)
        big = torch.zeros(1, 1, 2048, device=DEV, dtype=torch.bfloat16)
        assert "head_dim" in triton_attention_reason(big, kvb)
