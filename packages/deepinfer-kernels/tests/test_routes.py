"""Which kernel runs a dense FP8 GEMM or a routed-experts call: the routing table and plans of
`ops/linear.py` and `ops/moe.py` (pure functions, CPU)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.cuda import decode_gemm as dg
from deepinfer_kernels.ops import linear as L
from deepinfer_kernels.ops import moe as M
from hypothesis import given, settings
from hypothesis import strategies as st

C = dg.DecodeGemmCudaConfig
CONFIGS = {"2": C(2, 2), "3": C(1, 3), "4": C(1, 4)}

# [N, K] weights the decode kernel takes, on the H200's SM count or another
WEIGHTS_AND_SMS = dict(
    n=st.integers(1, 8192).map(lambda v: 8 * v),
    k=st.integers(1, 128).map(lambda v: 128 * v),
    sms=st.sampled_from([114, 132]),
)


def takes(m: int, n: int, k: int, batch_invariant: bool = False, sms: int = 132) -> bool:
    """Whether the cuda tier runs M tokens on [N, K] on its decode kernel."""
    return L.cuda_kernel(m, n, k, batch_invariant, sms) == "decode"


def test_decode_config_at_v4_shapes():
    assert L.cuda_decode_config(16, 5120, 8192) == C(consumers=1, min_blocks=3)  # 320 CTAs
    assert L.cuda_decode_config(16, 32768, 1280) == C(consumers=2, min_blocks=2)  # 256 CTAs


def test_routes_configs_run_and_the_plan_takes_them():
    """Every `ROUTES` entry names a config per M bucket that the kernel takes at that bucket's M,
    or the fill rule's (. and p); `cuda_decode_config` returns it on 132 SMs, and the fill rule on
    other SM counts and past the last bucket."""
    for (n, k), row in L.ROUTES.items():
        tokens = row.split()
        assert len(tokens) == len(L.ROUTE_M)
        lo = 1
        for top, token in zip(L.ROUTE_M, tokens, strict=True):
            for m in (lo, top):
                digit = token[0] if token[0] in CONFIGS else None
                want = CONFIGS[digit] if digit else dg.fill_config(m, n, k, 132)
                assert L.cuda_decode_config(m, n, k, 132) == want, (n, k, m)
                assert dg.shape_reason(n, k, m, want) is None, (n, k, m)
            lo = top + 1
        for m, sms in ((1, 114), (L.ROUTE_M[-1] + 1, 132)):
            assert L.cuda_decode_config(m, n, k, sms) == dg.fill_config(m, n, k, sms)


def test_routes_decide_the_kernel_per_bucket():
    """A digit or . runs the decode kernel in both modes, Dp the prefill kernel in auto mode only,
    p in both; no bucket up to 64 tokens goes to the prefill kernel."""
    assert L.ROUTE_M[-1] == L.CUDA_DECODE_MAX_M
    for (n, k), row in L.ROUTES.items():
        lo = 1
        for top, token in zip(L.ROUTE_M, row.split(), strict=True):
            assert token in {".", "p"} or (token[0] in CONFIGS and token[1:] in ("", "p"))
            for m in (lo, top):
                assert takes(m, n, k) == (not token.endswith("p")), (n, k, m)
                assert takes(m, n, k, batch_invariant=True) == (token != "p"), (n, k, m)
            assert top > 64 or (token[0] in CONFIGS and len(token) == 1)
            lo = top + 1


def test_takes_at_v4_shapes():
    """Measured routes: 5120x8192 at 65-128 tokens on the prefill kernel in auto mode only, at
    129-192 on the decode kernel, from 193 on the prefill kernel; 1280x5120 on the decode kernel
    up to 256; 2112x7168 from 193 on the prefill kernel in both modes; ROUTES counts on 132 SMs
    only (else the rule: up to 192, or 256 under PREFILL_N rows or in batch-invariant mode)."""
    assert takes(64, 5120, 8192) and not takes(65, 5120, 8192)
    assert takes(65, 5120, 8192, batch_invariant=True) and takes(192, 5120, 8192)
    assert not takes(193, 5120, 8192) and not takes(256, 5120, 8192, batch_invariant=True)
    assert takes(256, 1280, 5120) and not takes(256, 2112, 7168)
    assert takes(192, 2112, 7168) and not takes(256, 2112, 7168, batch_invariant=True)
    assert takes(64, 4096, 5120) and not takes(65, 4096, 5120, batch_invariant=True)
    assert not takes(257, 1280, 5120) and not takes(257, 1280, 5120, batch_invariant=True)
    assert takes(64, 32768, 1280) and not takes(96, 32768, 1280)
    assert takes(160, 32768, 1280) and not takes(96, 32768, 1280, batch_invariant=True)
    assert takes(96, 32768, 1280, sms=114) and not takes(193, 32768, 1280, sms=114)
    assert takes(256, 32768, 1280, batch_invariant=True, sms=114)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 400), **WEIGHTS_AND_SMS)
def test_auto_mode_takes_a_subset_of_batch_invariant_mode(m, n, k, sms):
    """Auto mode sends to the decode kernel no M that batch-invariant mode would not, and every
    M <= 64; no mode sends M > CUDA_DECODE_MAX_M; batch-invariant mode sends every M up to it of
    weights not measured."""
    assert not takes(m, n, k, False, sms) or takes(m, n, k, True, sms)
    assert takes(m, n, k, False, sms) or m > 64
    assert not takes(m, n, k, True, sms) or m <= L.CUDA_DECODE_MAX_M
    if sms != 132 or (n, k) not in L.ROUTES:
        assert takes(m, n, k, True, sms) == (m <= L.CUDA_DECODE_MAX_M)


E3 = (torch.float8_e8m0fnu,) * 3
F3 = (torch.float8_e8m0fnu, torch.float32, torch.float8_e8m0fnu)
H200 = dict(capability=(9, 0), sms=132, tiers=("cuda", "triton", "ref"))


@pytest.mark.parametrize("op", ["fp8_gemm", "fp8_linear"])
@pytest.mark.parametrize("bi", [False, True])
def test_plans_at_v4_shapes(op, bi):
    """On an H200 the cuda tier plans every V4.1 call, the triton and ref tiers after it; the
    decode kernel up to 64 tokens; the triton tier's GEMV only at M = 1 in auto mode."""
    for n, k in L.ROUTES:
        for m in (1, 16, 64, 100, 256, 257, 8192):
            plans, passed = L.plan(op, m, n, k, torch.bfloat16, bi, **H200)
            assert [p.tier for p in plans] == ["cuda", "triton", "ref"] and not passed
            assert plans[0].kernel == L.cuda_kernel(m, n, k, bi)
            assert plans[0].kernel == "decode" or m > 64
            assert (plans[1].kernel == "gemv") == (m == 1 and not bi)


def test_plans_name_why_a_tier_is_passed_over():
    plans, passed = L.plan("fp8_gemm", 16, 5120, 8192, torch.float16, False, **H200)
    assert [p.tier for p in plans] == ["triton", "ref"]
    assert passed == ("cuda: out_dtype torch.float16: the cuda GEMM writes bfloat16 or float32",)
    plans, passed = L.plan(
        "fp8_gemm", 16, 5120, 8192, torch.bfloat16, False, (10, 0), 148, ("cuda", "ref")
    )
    assert [p.tier for p in plans] == ["ref"] and "sm_90a" in passed[0]
    plans, passed = L.plan("fp8_gemm", 16, 5120, 8160, torch.bfloat16, False, **H200)
    assert plans[0].tier == "triton" and "multiple of 128" in passed[0]


def test_the_registry_resolves_planned_ops_on_cpu():
    from deepinfer_kernels import REGISTRY, quant

    w, ws = quant.quantize_fp8_blocks(torch.randn(64, 64))
    x = torch.randn(3, 64)
    xq, xs = quant.act_quant_fp8(x)
    assert REGISTRY.resolve("fp8_linear", x, w, ws).tier == "ref"
    assert REGISTRY.resolve("fp8_gemm", xq, xs, w, ws, torch.bfloat16).tier == "ref"
    with pytest.raises(TypeError, match=r"call ops\.fp8_gemm"):
        REGISTRY.call("fp8_gemm", xq, xs, w, ws)
    w1, s1 = quant.quantize_fp4_experts(torch.randn(2 * 64, 64))
    w2, s2 = quant.quantize_fp4_experts(torch.randn(2 * 64, 64))
    stack = [t.view(2, 64, -1) for t in (w1, s1, w1, s1, w2, s2)]
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    tw = torch.full((3, 2), 0.5)
    assert REGISTRY.resolve("moe_experts", x, tw, ids, *stack, 10.0).tier == "ref"


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.integers(1, 16384),
    topk=st.sampled_from([1, 2, 6, 8]),
    experts=st.sampled_from([4, 16, 64, 256, 384]),
    bi=st.booleans(),
    fo=st.booleans(),
    aligned=st.booleans(),
)
def test_moe_configs(tokens, topk, experts, bi, fo, aligned):
    """The cuda tier: prefill-sized routing (more pairs per expert than the mode's threshold) the
    wgmma prefill kernels, else the decode kernels: wgmma in batch-invariant mode or on
    fragment-order weights, mma.sync otherwise (by registers only for unaligned weights). The
    Triton tier switches tiles at PREFILL_PAIRS_PER_EXPERT in both modes."""
    from deepinfer_kernels.cuda import moe as cuda_moe

    pairs = tokens * topk
    cfg = M.cuda_config(bi, fo, tokens, pairs, experts, aligned)
    limit = M.PREFILL_PAIRS_PER_EXPERT if bi else M.CUDA_PREFILL_PAIRS_PER_EXPERT
    prefill = pairs > limit * experts
    wgmma = isinstance(cfg, cuda_moe.MoeDecodeWgmmaConfig)
    assert wgmma == (prefill or bi or fo)
    if wgmma:
        assert cfg.fragment_weights == fo and (cfg.permuted_k == (prefill and not bi and not fo))
        assert (cfg.tile_tokens >= 128) == prefill
    else:
        assert cfg.tma == aligned
    tri = M.triton_config(pairs, experts, bi, fo)
    assert (tri.block_m == 64) == (pairs > M.PREFILL_PAIRS_PER_EXPERT * experts)
    assert tri.fragment_weights == fo


def test_moe_plans_pass_over_what_a_tier_cannot_run():
    h200 = ((9, 0), ("cuda", "triton", "ref"))
    plans, passed = M.plan(16, 6, 384, 4096, 2048, torch.bfloat16, E3, True, False, False, *h200)
    assert [p.tier for p in plans] == ["cuda", "triton", "ref"] and not passed
    plans, passed = M.plan(16, 6, 384, 4096, 2048, torch.float32, E3, True, False, False, *h200)
    assert plans[0].tier == "triton" and "bfloat16" in passed[0]
    plans, passed = M.plan(16, 6, 384, 4096, 2048, torch.bfloat16, E3, True, False, True, *h200)
    assert plans[0].tier == "triton" and "checkpoint's order" in passed[0]
    plans, passed = M.plan(16, 6, 384, 4096, 2048, torch.bfloat16, F3, True, True, False, *h200)
    assert [p.tier for p in plans] == ["ref"] and len(passed) == 2


def test_a_cuda_plan_checks_the_operands_layout():
    """A call whose operands the cuda kernels cannot take (not contiguous, not 16-byte aligned)
    falls to the next plan: the check runs per call, on CPU tensors too."""
    from deepinfer_kernels import quant

    w, ws = quant.quantize_fp8_blocks(torch.randn(64, 128))
    xq, xs = quant.act_quant_fp8(torch.randn(4, 128))
    cuda = L.GemmPlan("cuda", "decode", None)
    assert L._operand_reason(cuda, "fp8_gemm", (xq, xs, w, ws, torch.bfloat16)) is None
    strided = xq.t().contiguous().t()
    why = L._operand_reason(cuda, "fp8_gemm", (strided, xs, w, ws, torch.bfloat16))
    assert why == "x_fp8 is not contiguous"
    x = torch.randn(4, 128)
    assert L._operand_reason(cuda, "fp8_linear", (x, w, ws)) is None
    assert "w must be contiguous" in L._operand_reason(cuda, "fp8_linear", (x, w.t(), ws))
    assert L._operand_reason(L.GemmPlan("triton", "tiles"), "fp8_gemm", (strided,)) is None
