"""The triton tiers of the per-token ops (rms_norm, rope, hc_mixes, hc_split_sinkhorn, hc_pre,
hc_post) on small shapes, against float64 math written here and against the ref tier.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU (set before they are defined); with
CUDA they run compiled. The interpreter converts fp32 to bf16 by truncation (the GPU rounds to
nearest), so bf16 outputs are held to a bf16 tolerance here and fp32 paths to fp32 tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer_kernels.ref import mhc as ref_mhc
from deepinfer_kernels.ref import norm as ref_norm
from deepinfer_kernels.ref import rope as ref_rope
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_tier import DEV, triton_module

tm = triton_module("mhc")
tn = triton_module("norm")
tr = triton_module("rope")

SETTINGS = settings(max_examples=6, deadline=None)
TOKENS = st.sampled_from([1, 2, 3, 5, 8, 17])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _rand(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed), device=DEV) * scale).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in output: an element was not written"
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# -- float64 math, independent of the code under test ------------------------------------------


def f64_rms_norm(x, w, eps):
    x = x.double()
    return w.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def f64_rope(x, pos, inv_freq, inverse):
    # the angle is specified as fp32(position) * inv_freq rounded to fp32; the rest in float64
    ang = (pos.float()[:, None] * inv_freq.float()[None, :]).double()
    ang = ang.view(x.shape[0], *([1] * (x.dim() - 2)), -1)
    sgn = -1.0 if inverse else 1.0
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    c, s = torch.cos(ang), sgn * torch.sin(ang)
    out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def f64_sinkhorn(mixes, scale, base, hc, iters, eps):
    m, s, b = mixes.double(), scale.double(), base.double()
    t = m.shape[0]
    pre = torch.zeros(t, hc, dtype=torch.float64)
    post = torch.zeros(t, hc, dtype=torch.float64)
    comb = torch.zeros(t, hc, hc, dtype=torch.float64)
    for i in range(t):
        for k in range(hc):
            pre[i, k] = 1 / (1 + math.exp(-(m[i, k] * s[0] + b[k]))) + eps
            post[i, k] = 2 / (1 + math.exp(-(m[i, hc + k] * s[1] + b[hc + k])))
        c = [[float(m[i, 2 * hc + j * hc + k] * s[2] + b[2 * hc + j * hc + k]) for k in range(hc)]
             for j in range(hc)]  # fmt: skip
        for j in range(hc):
            mx = max(c[j])
            z = sum(math.exp(v - mx) for v in c[j])
            c[j] = [math.exp(v - mx) / z + eps for v in c[j]]
        for it in range(iters):
            if it:
                c = [[v / (sum(r) + eps) for v in r] for r in c]
            cs = [sum(c[j][k] for j in range(hc)) + eps for k in range(hc)]
            c = [[c[j][k] / cs[k] for k in range(hc)] for j in range(hc)]
        comb[i] = torch.tensor(c, dtype=torch.float64)
    return pre, post, comb


def f64_hc_pre(h, pre):
    return torch.einsum("tk,tkd->td", pre.double(), h.double())


def f64_hc_post(y, res, post, comb):
    return post.double()[:, :, None] * y.double()[:, None, :] + torch.einsum(
        "tjk,tjd->tkd", comb.double(), res.double()
    )


def f64_hc_mixes(h, fn, eps):
    x = h.double().flatten(1)
    return (x @ fn.double().t()) / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


# -- rms_norm ------------------------------------------------------------------------------------


@SETTINGS
@given(t=TOKENS, d=st.sampled_from([16, 96, 130]), seed=st.integers(0, 2**16))
def test_rms_norm_matches_f64_and_ref(t, d, seed):
    x = _rand(t, d, seed=seed, scale=3.0)
    w = _rand(d, seed=seed + 1)
    got = tn.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert _rel(got, f64_rms_norm(x, w, 1e-6)) < 1e-6
    assert _rel(got, ref_norm.rms_norm(x, w, 1e-6)) < 1e-6


def test_rms_norm_bf16_strided_rows_and_two_pass(monkeypatch):
    # a row slice of a wider tensor (strided rows, no copy) and rows wider than the block
    base = _rand(3, 4, 160, seed=3, dtype=torch.bfloat16, scale=2.0)
    x = base[..., 16:144]
    w = _rand(128, seed=4, dtype=torch.bfloat16)
    got = tn.rms_norm(x, w, 1e-20)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert _rel(got, f64_rms_norm(x, w, 1e-20)) < 1e-2
    monkeypatch.setattr(tn, "_MAX_BLOCK", 32)  # forces the chunked two-pass path
    x32 = _rand(5, 100, seed=5)
    w32 = _rand(100, seed=6)
    assert _rel(tn.rms_norm(x32, w32, 1e-6), f64_rms_norm(x32, w32, 1e-6)) < 1e-6


def test_rms_norm_zero_row_stays_zero():
    x = _rand(3, 64, seed=7)
    x[1] = 0.0
    out = tn.rms_norm(x, _rand(64, seed=8), 1e-20)
    assert torch.equal(out[1], torch.zeros(64, device=DEV))


# -- rope ----------------------------------------------------------------------------------------


@SETTINGS
@given(
    t=TOKENS,
    heads=st.sampled_from([1, 3, 9]),
    half=st.sampled_from([4, 8, 5]),
    inverse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rope_matches_f64_and_ref(t, heads, half, inverse, seed):
    rd = 2 * half
    wide = _rand(t, heads, rd + 6, seed=seed)
    x = wide[..., -rd:]  # the model's tail slice: strided rows
    pos = torch.randint(0, 200_000, (t,), generator=_gen(seed), device=DEV)
    inv_freq = torch.rand(half, generator=_gen(seed + 1), device=DEV)
    got = tr.rope(x, pos, inv_freq, inverse)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert _rel(got, f64_rope(x, pos, inv_freq, inverse)) < 1e-5
    assert _rel(got, ref_rope.rope(x, pos, inv_freq, inverse)) < 1e-5


def test_rope_2d_bf16_float_positions_and_inverse_roundtrip():
    x = _rand(5, 16, seed=11, dtype=torch.bfloat16)
    pos = torch.tensor([0.0, 1.0, 7.0, 100.0, 3.0], device=DEV)
    inv_freq = torch.rand(8, generator=_gen(12), device=DEV)
    got = tr.rope(x, pos, inv_freq)
    assert _rel(got, f64_rope(x, pos, inv_freq, False)) < 1e-2
    assert torch.equal(got[0], x[0])  # position 0 is the identity
    x32 = x.float()
    back = tr.rope(tr.rope(x32, pos, inv_freq), pos, inv_freq, inverse=True)
    assert _rel(back, x32) < 1e-6


def test_rope_bad_shapes_raise():
    x = _rand(3, 2, 8, seed=13)
    with pytest.raises(ValueError, match="inv_freq"):
        tr.rope(x, torch.zeros(3, device=DEV), torch.ones(3, device=DEV))
    with pytest.raises(ValueError, match="positions"):
        tr.rope(x, torch.zeros(4, device=DEV), torch.ones(4, device=DEV))


# -- mHC -----------------------------------------------------------------------------------------


@SETTINGS
@given(
    t=TOKENS, hc=st.sampled_from([4, 3]), iters=st.sampled_from([1, 20]), seed=st.integers(0, 99)
)
def test_hc_split_sinkhorn_matches_f64_and_ref(t, hc, iters, seed):
    mix = (2 + hc) * hc
    mixes = _rand(t, mix, seed=seed, scale=2.0)
    scale = torch.rand(3, generator=_gen(seed + 1), device=DEV) + 0.5
    base = _rand(mix, seed=seed + 2)
    got = tm.hc_split_sinkhorn(mixes, scale, base, hc, iters, 1e-6)
    want = f64_sinkhorn(mixes.cpu(), scale.cpu(), base.cpu(), hc, iters, 1e-6)
    ref = ref_mhc.hc_split_sinkhorn(mixes, scale, base, hc, iters, 1e-6)
    for g, w, r in zip(got, want, ref, strict=True):
        assert g.dtype == torch.float32 and g.shape == r.shape
        assert _rel(g.cpu(), w) < 1e-6
        assert _rel(g, r) < 1e-6


@SETTINGS
@given(t=TOKENS, d=st.sampled_from([32, 600]), seed=st.integers(0, 2**16))
def test_hc_pre_and_post_match_f64(t, d, seed):
    hc = 4
    h = _rand(t, hc, d, seed=seed)
    pre = torch.rand(t, hc, generator=_gen(seed + 1), device=DEV)
    got = tm.hc_pre(h, pre)
    assert got.shape == (t, d) and got.dtype == h.dtype
    assert _rel(got, f64_hc_pre(h, pre)) < 1e-6
    assert _rel(got, ref_mhc.hc_pre(h, pre)) < 1e-6
    y = _rand(t, d, seed=seed + 2)
    post = torch.rand(t, hc, generator=_gen(seed + 3), device=DEV) * 2
    comb = torch.rand(t, hc, hc, generator=_gen(seed + 4), device=DEV)
    got = tm.hc_post(y, h, post, comb)
    assert got.shape == (t, hc, d) and got.dtype == y.dtype
    assert _rel(got, f64_hc_post(y, h, post, comb)) < 1e-6
    assert _rel(got, ref_mhc.hc_post(y, h, post, comb)) < 1e-6


def test_hc_pre_post_bf16():
    t, hc, d = 3, 4, 520
    h = _rand(t, hc, d, seed=21, dtype=torch.bfloat16)
    pre = torch.rand(t, hc, generator=_gen(22), device=DEV)
    assert _rel(tm.hc_pre(h, pre), f64_hc_pre(h, pre)) < 1e-2
    y = _rand(t, d, seed=23, dtype=torch.bfloat16)
    post = torch.rand(t, hc, generator=_gen(24), device=DEV)
    comb = torch.rand(t, hc, hc, generator=_gen(25), device=DEV)
    out = tm.hc_post(y, h, post, comb)
    assert out.dtype == torch.bfloat16
    assert _rel(out, f64_hc_post(y, h, post, comb)) < 1e-2


@SETTINGS
@given(t=TOKENS, d=st.sampled_from([64, 300]), seed=st.integers(0, 2**16))
def test_hc_mixes_matches_f64_and_ref(t, d, seed):
    hc = 4
    h = _rand(t, hc, d, seed=seed, dtype=torch.bfloat16)
    fn = _rand((2 + hc) * hc, hc * d, seed=seed + 1, scale=0.1)
    got = tm.hc_mixes(h, fn, 1e-20)
    assert got.shape == (t, (2 + hc) * hc) and got.dtype == torch.float32
    assert _rel(got, f64_hc_mixes(h, fn, 1e-20)) < 1e-5
    assert _rel(got, ref_mhc.hc_mixes(h, fn, 1e-20)) < 1e-5


def test_per_token_ops_are_batch_invariant():
    """A token's outputs do not depend on the other tokens of the call (alone, or among 37).

    hc_mixes is the one op with a `tl.dot`. Compiled, the dot's order is the kernel's: bitwise
    here, and in test_gpu_small_ops.py. Under the interpreter it is numpy's matmul, whose
    summation order depends on the BLAS build (OPENBLAS_CORETYPE, ...) and on where a row sits in
    the 16-token tile, so there each call's mixes are held per element to the float64 math, at a
    bound (16 fp32 roundoffs of sum |x| |w|) far below what a row or K-chunk mix-up would cost.
    The ops without a dot get the same mixes and must be bitwise equal everywhere."""
    t, hc, d = 37, 4, 1100  # several K splits in hc_mixes, several D blocks in hc_pre/post
    h = _rand(t, hc, d, seed=31, dtype=torch.bfloat16)
    fn = _rand((2 + hc) * hc, hc * d, seed=32, scale=0.1)
    scale, base = torch.rand(3, device=DEV) + 0.5, _rand((2 + hc) * hc, seed=33)
    y = _rand(t, d, seed=34, dtype=torch.bfloat16)
    w = _rand(d, seed=35, dtype=torch.bfloat16)
    pos = torch.arange(t, device=DEV) * 977
    inv_freq = torch.rand(32, device=DEV)
    xr = _rand(t, 5, 64, seed=36, dtype=torch.bfloat16)
    want = f64_hc_mixes(h, fn, 1e-20)
    bound = 2.0**-20 * f64_hc_mixes(h.abs(), fn.abs(), 1e-20)  # 2**-20: 16 fp32 roundoffs

    def mixes(rows):
        got = tm.hc_mixes(h[rows], fn, 1e-20)
        assert ((got.double() - want[rows]).abs() <= bound[rows]).all()
        return got

    def rest(rows, mix):
        pre, post, comb = tm.hc_split_sinkhorn(mix, scale, base, hc, 20, 1e-6)
        return (
            pre,
            post,
            comb,
            tm.hc_pre(h[rows], pre),
            tm.hc_post(y[rows], h[rows], post, comb),
            tn.rms_norm(y[rows], w, 1e-20),
            tr.rope(xr[rows], pos[rows], inv_freq),
        )

    full_mixes = mixes(slice(0, t))
    full = rest(slice(0, t), full_mixes)
    for rows in (slice(20, 21), slice(3, 20)):
        part = mixes(rows)
        if DEV == "cuda":
            assert torch.equal(part, full_mixes[rows])
        for a, b in zip(rest(rows, full_mixes[rows]), full, strict=True):
            assert torch.equal(a, b[rows])


def test_hc_mixes_triton_dispatch_limit(monkeypatch):
    """The triton hc_mixes takes any T in batch-invariant mode, else at most 128 tokens."""
    from deepinfer_kernels.ops import mhc as ops_mhc

    monkeypatch.setattr(ops_mhc, "cuda_input_reason", lambda *a, **k: None)
    fn = torch.zeros(24, 4 * 8)
    small, big = torch.zeros(128, 4, 8), torch.zeros(129, 4, 8)
    assert ops_mhc.mixes_triton_reason(small, fn, 1e-20, batch_invariant=False) is None
    assert "129 > 128" in ops_mhc.mixes_triton_reason(big, fn, 1e-20, batch_invariant=False)
    assert ops_mhc.mixes_triton_reason(big, fn, 1e-20, batch_invariant=True) is None
    monkeypatch.undo()
    assert "cpu" in ops_mhc.mixes_triton_reason(small, fn, 1e-20, batch_invariant=True)
