"""The triton tiers of the per-token ops at V4.1-Flash shapes on CUDA, through the registry:
against the ref tier (relative-norm error, METHOD.md's tolerances), every output element written
(outputs land on NaN-poisoned memory), batch invariance bitwise, and no host<->device sync in the
ops or in quant's format helpers. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels import REGISTRY, ops, quant
from deepinfer_kernels.ref import mhc as ref_mhc
from deepinfer_kernels.ref import norm as ref_norm
from deepinfer_kernels.ref import rope as ref_rope
from gpu_checks import poison, rel

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the triton tier runs on CUDA only)"
)

DEV = "cuda"
D, HC, MIX = 5120, 4, 24  # hidden, hc_mult, (2 + hc) * hc
HEADS, HEAD_DIM, RD = 64, 512, 64
TOKENS = [1, 7, 64, 300]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed), device=DEV) * scale).to(dtype)


def _tier(op: str, *args, **kwargs) -> str:
    return REGISTRY.resolve(op, *args, **kwargs).tier


def _inputs(t: int, seed: int) -> dict[str, torch.Tensor]:
    return {
        "h": _randn(t, HC, D, seed=seed, dtype=torch.bfloat16),
        "fn": _randn(MIX, HC * D, seed=seed + 1, scale=0.02),
        "mixes": _randn(t, MIX, seed=seed + 2, scale=2.0),
        "scale": torch.rand(3, generator=_gen(seed + 3), device=DEV) + 0.5,
        "base": _randn(MIX, seed=seed + 4),
        "pre": torch.rand(t, HC, generator=_gen(seed + 5), device=DEV),
        "post": 2 * torch.rand(t, HC, generator=_gen(seed + 6), device=DEV),
        "comb": torch.rand(t, HC, HC, generator=_gen(seed + 7), device=DEV) / HC,
        "y": _randn(t, D, seed=seed + 8, dtype=torch.bfloat16),
        "w": (1 + 0.1 * _randn(D, seed=seed + 9)).to(torch.bfloat16),
        "q": _randn(t, HEADS, HEAD_DIM, seed=seed + 10, dtype=torch.bfloat16),
        "kv": _randn(t, HEAD_DIM, seed=seed + 11, dtype=torch.bfloat16),
        "pos": torch.randint(0, 1 << 20, (t,), generator=_gen(seed + 12), device=DEV),
        "inv_freq": 10000.0 ** -(torch.arange(0, RD, 2, device=DEV).float() / RD),
    }


@pytest.mark.parametrize("t", TOKENS)
def test_mhc_ops_match_ref(t):
    from deepinfer_kernels.triton import mhc as tri_mhc

    a = _inputs(t, 100 + t)
    # outside batch-invariant mode the registry sends hc_mixes over 128 tokens to ref (faster)
    bi = REGISTRY.batch_invariant
    want_tier = "triton" if t <= 128 or bi else "ref"
    assert _tier("hc_mixes", a["h"], a["fn"], 1e-20, batch_invariant=bi) == want_tier
    poison()
    want = ref_mhc.hc_mixes(a["h"], a["fn"], 1e-20)
    assert rel(tri_mhc.hc_mixes(a["h"], a["fn"], 1e-20), want) < 1e-5

    args = (a["mixes"], a["scale"], a["base"], HC, 20, 1e-6)
    assert _tier("hc_split_sinkhorn", *args) == "triton"
    poison()
    for got, want in zip(
        ops.hc_split_sinkhorn(*args), ref_mhc.hc_split_sinkhorn(*args), strict=True
    ):
        assert rel(got, want) < 1e-6

    assert _tier("hc_pre", a["h"], a["pre"]) == "triton"
    poison()
    got, want = ops.hc_pre(a["h"], a["pre"]), ref_mhc.hc_pre(a["h"], a["pre"])
    assert rel(got, want) < 1e-2
    assert (got != want).float().mean().item() < 0.02  # bf16 rounding of a near-equal fp32 sum

    post_args = (a["y"], a["h"], a["post"], a["comb"])
    assert _tier("hc_post", *post_args) == "triton"
    poison()
    got, want = ops.hc_post(*post_args), ref_mhc.hc_post(*post_args)
    assert rel(got, want) < 1e-2
    assert (got != want).float().mean().item() < 0.02


@pytest.mark.parametrize("t", TOKENS)
def test_rms_norm_and_rope_match_ref(t):
    a = _inputs(t, 200 + t)
    assert _tier("rms_norm", a["y"], a["w"], 1e-20) == "triton"
    poison()
    got, want = ops.rms_norm(a["y"], a["w"], 1e-20), ref_norm.rms_norm(a["y"], a["w"], 1e-20)
    assert rel(got, want) < 1e-2
    assert (got != want).float().mean().item() < 0.02
    x32 = _randn(t, 1280, seed=5, scale=3.0)
    w32 = _randn(1280, seed=6)
    assert rel(ops.rms_norm(x32, w32, 1e-6), ref_norm.rms_norm(x32, w32, 1e-6)) < 1e-6

    for x in (a["q"][..., -RD:], a["kv"][..., -RD:]):  # the model's tail slices (strided)
        for inverse in (False, True):
            args = (x, a["pos"], a["inv_freq"], inverse)
            assert _tier("rope", *args) == "triton"
            poison()
            got, want = ops.rope(*args), ref_rope.rope(*args)
            assert got.shape == x.shape and got.dtype == x.dtype
            assert rel(got, want) < 1e-2
            assert (got != want).float().mean().item() < 0.02
            g32, w32_ = ops.rope(x.float(), *args[1:]), ref_rope.rope(x.float(), *args[1:])
            assert rel(g32, w32_) < 1e-6


def test_per_token_ops_are_batch_invariant(batch_invariant):
    """Token rows computed alone or in a call of 300 are bitwise equal (batch-invariant mode: it
    keeps hc_mixes on the triton tier at every T)."""
    t = 300
    a = _inputs(t, 7)

    def run(rows):
        mixes = ops.hc_mixes(a["h"][rows], a["fn"], 1e-20)
        pre, post, comb = ops.hc_split_sinkhorn(mixes, a["scale"], a["base"], HC, 20, 1e-6)
        return (
            mixes,
            pre,
            post,
            comb,
            ops.hc_pre(a["h"][rows], pre),
            ops.hc_post(a["y"][rows], a["h"][rows], post, comb),
            ops.rms_norm(a["y"][rows], a["w"], 1e-20),
            ops.rope(a["q"][rows][..., -RD:], a["pos"][rows], a["inv_freq"]),
        )

    full = run(slice(0, t))
    for rows in (slice(0, 1), slice(123, 124), slice(17, 81)):
        for got, want in zip(run(rows), full, strict=True):
            assert torch.equal(got, want[rows])


def test_quant_helpers_match_tensor_constants_bitwise_and_do_not_sync():
    """The Python-float constants give the bits the old fp32 tensor constants gave, and neither the
    quant helpers nor the triton ops copy between host and device (sync debug mode errors)."""
    x = _randn(64, 4096, seed=1, scale=3.0)
    x[0, :32] = 0.0  # the amax floor
    _, s = quant.act_quant_fp8(x)
    groups = x.unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1).clamp_min(quant.ACT_AMAX_FLOOR)
    old = quant.pow2_ceil(amax * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=DEV))
    assert torch.equal(s, old)
    w = _randn(16, 256, seed=2)
    packed, ws = quant.quantize_fp4_experts(w)
    g4 = w.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True).clamp_min(6.0 * 2.0**-126)
    old4 = quant.pow2_ceil(g4 * torch.tensor(1.0 / 6.0, dtype=torch.float32, device=DEV))
    assert torch.equal(ws.float(), old4.squeeze(-1))
    codes = torch.arange(256, device=DEV, dtype=torch.int32).to(torch.uint8)
    table = torch.tensor(quant.FP4_VALUES + tuple(-v for v in quant.FP4_VALUES), device=DEV)
    want = table[(codes.to(torch.int32) & 0xF).long()]
    assert torch.equal(quant.e2m1_value(codes).view(torch.int32), want.view(torch.int32))

    a = _inputs(64, 3)

    def step():
        quant.act_quant_fp8(x)
        quant.dequantize_fp4(packed, ws)
        quant.fake_quant_fp4_ue8m0(x)
        mixes = ops.hc_mixes(a["h"], a["fn"], 1e-20)
        pre, post, comb = ops.hc_split_sinkhorn(mixes, a["scale"], a["base"], HC, 20, 1e-6)
        ops.hc_post(ops.rms_norm(ops.hc_pre(a["h"], pre), a["w"], 1e-20), a["h"], post, comb)
        ops.rope(a["q"][..., -RD:], a["pos"], a["inv_freq"])

    step()  # compile and cache first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
