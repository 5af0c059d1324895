"""GPU tiers against the ref tier on fresh random inputs (relative-norm errors, METHOD.md's
tolerances), every output element written (outputs land on NaN-poisoned memory), and batch
invariance bitwise. Skipped without CUDA; on the H200: `pytest packages/deepinfer-kernels/tests`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from deepinfer_kernels import quant
from deepinfer_kernels.ops.moe import triton_moe_experts
from deepinfer_kernels.ref import linear as ref_linear
from deepinfer_kernels.ref import moe as ref_moe
from deepinfer_kernels.ref import quant as ref_quant
from gpu_checks import assert_graph_replays_new_routing, gemm_inputs, moe_inputs, poison, rel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (triton tier)")
pytestmark = cuda

DEV = "cuda"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def tri_gemm(xq, xs, w, ws, out_dtype, batch_invariant=False, config=None):
    """The triton tier's fp8_gemm with `config` (None: its plan for this call in that mode)."""
    from deepinfer_kernels import REGISTRY
    from deepinfer_kernels.ops import linear as linear_ops
    from deepinfer_kernels.triton import linear as tl_linear

    if config is not None:
        kw = dict(batch_invariant=batch_invariant, config=config)
        return tl_linear.fp8_gemm(xq, xs, w, ws, out_dtype, **kw)
    with REGISTRY.batch_invariant_mode(batch_invariant):
        return linear_ops.run_on("triton", "fp8_gemm", xq, xs, w, ws, out_dtype)


def tri_linear(x, w, ws, batch_invariant=False):
    """The triton tier's fp8_linear with its plan for this call in that mode."""
    from deepinfer_kernels import REGISTRY
    from deepinfer_kernels.ops import linear as linear_ops

    with REGISTRY.batch_invariant_mode(batch_invariant):
        return linear_ops.run_on("triton", "fp8_linear", x, w, ws)


# -- activation quantisation -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 32), (7, 5120), (300, 2304), (3, 4, 1280)])
def test_act_quant_matches_ref_bitwise(dtype, shape):
    from deepinfer_kernels.triton import quant as tq

    x = (torch.randn(shape, device=DEV, generator=_gen(1)) * 4).to(dtype)
    x.view(-1)[:32] = 0.0  # a zero group: the amax floor
    poison()
    q, s = tq.act_quant_fp8(x)
    rq, rs = ref_quant.act_quant_fp8(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def _quantised_close(q, s, rq, rs):
    got = quant.act_dequant_fp8(q, s)
    want = quant.act_dequant_fp8(rq, rs)
    assert rel(got, want) < 1e-2
    assert (got != want).float().mean().item() < 0.01


# -- FP8 GEMM ------------------------------------------------------------------------------------


SHAPES = [
    (1, 40, 64),
    (7, 512, 160),
    (33, 2112, 2048),
    (64, 1024, 1280),
    (130, 96, 5120),
    (257, 2304, 512),
    (1000, 640, 1024),
]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fp8_gemm_close_to_ref(m, n, k):
    xq, xs, w, ws = gemm_inputs(m, n, k, seed=m + n + k)
    want = ref_linear.fp8_gemm(xq, xs, w, ws, torch.float32)
    poison()
    got = tri_gemm(xq, xs, w, ws, torch.float32)
    assert rel(got, want) < 1e-3
    got16 = tri_gemm(xq, xs, w, ws, torch.bfloat16)
    assert got16.dtype == torch.bfloat16 and rel(got16, want) < 1e-2


@pytest.mark.parametrize("mode", ["split4", "bk64", "bf16", "fp32scale", "invariant"])
def test_fp8_gemm_variants(mode):
    from deepinfer_kernels.triton import linear as tl_linear

    m, n, k = 45, 384, 1280
    xq, xs, w, ws = gemm_inputs(m, n, k, seed=7)
    want = ref_linear.fp8_gemm(xq, xs, w, ws, torch.float32)
    cfg = {
        "split4": tl_linear.GemmConfig(16, 64, 4, 4, 3),
        "bk64": tl_linear.GemmConfig(64, 64, 1, 4, 4, block_k=64),
        "bf16": tl_linear.GemmConfig(128, 128, 1, 8, 4),
        "fp32scale": None,
        "invariant": tl_linear.decode_config(45, 384, 1280, True),
    }[mode]
    scale = ws.float() if mode == "fp32scale" else ws
    poison()
    got = tri_gemm(xq, xs, w, scale, torch.float32, config=cfg)
    assert rel(got, want) < 1e-3


def test_fp8_linear_op_dispatches_to_the_gpu_tier():
    """The triton tier, or on Hopper with NVRTC the cuda tier's decode kernel (tried first)."""
    from deepinfer_kernels import REGISTRY, ops
    from deepinfer_kernels.cuda import module

    x = torch.randn(5, 256, device=DEV, generator=_gen(8)).bfloat16()
    w, ws = quant.quantize_fp8_blocks(torch.randn(128, 256, device=DEV, generator=_gen(9)))
    hopper = torch.cuda.get_device_capability() == (9, 0) and module.nvrtc_reason() is None
    assert REGISTRY.resolve("fp8_linear", x, w, ws).tier == ("cuda" if hopper else "triton")
    got = ops.fp8_linear(x, w, ws)
    assert rel(got, ref_linear.fp8_linear(x, w, ws)) < 1e-2


@pytest.mark.parametrize(("n", "k"), [(2112, 7168), (512, 1280)])
def test_fp8_gemm_batch_invariant_bitwise(n, k):
    xq, xs, w, ws = gemm_inputs(301, n, k, seed=11)
    full = tri_gemm(xq, xs, w, ws, torch.bfloat16, batch_invariant=True)
    for lo, hi in ((0, 1), (17, 18), (300, 301), (5, 69), (100, 300)):
        part = tri_gemm(xq[lo:hi], xs[lo:hi], w, ws, torch.bfloat16, batch_invariant=True)
        assert torch.equal(part, full[lo:hi])


# -- MoE -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("t", "e"), [(1, 8), (5, 384), (300, 64), (2000, 16)])
def test_moe_gate_close_to_ref(t, e):
    from deepinfer_kernels.triton import moe as tmoe

    g = _gen(t + e)
    d = 512
    x = torch.randn(t, d, device=DEV, generator=g).bfloat16()
    wg = (torch.randn(e, d, device=DEV, generator=g) * 0.05).bfloat16()
    bias = torch.randn(e, device=DEV, generator=g) * 0.1
    k = min(6, e)
    rw, ri = ref_moe.moe_gate(x, wg, bias, k, 1.5, 1.0)
    poison()
    gw, gi = tmoe.moe_gate(x, wg, bias, k, 1.5, 1.0)
    same = (gi.sort(-1).values == ri.sort(-1).values).all(-1)
    assert same.float().mean().item() >= 0.99  # near-ties in fp32 may swap an expert
    order_g, order_r = gi.argsort(-1), ri.argsort(-1)
    wg_sorted = gw.gather(-1, order_g)[same]
    wr_sorted = rw.gather(-1, order_r)[same]
    assert rel(wg_sorted, wr_sorted) < 1e-5


PREFILL_CANDIDATES = {
    "m64w4": dict(cols_fast=True),
    "m64w4_rowfast2": dict(cols_fast=True, cols_fast2=False),
}
"""Prefill configurations measured as candidates for `PREFILL` (64-row tiles, 4 warps); "m64w4" is
the one chosen (now `PREFILL` itself), "m64w4_rowfast2" its variant with W2's row-fast grid."""


def _prefill_candidate(name):
    from deepinfer_kernels.triton import moe as tmoe

    return tmoe.MoeConfig(
        64,
        64,
        128,
        4,
        4,
        3,
        block_k=64,
        prefetch_scales=True,
        **PREFILL_CANDIDATES[name],
    )


MOE_SHAPES = [
    (1, 256, 128, 8, 2),
    (3, 512, 256, 16, 6),
    (64, 256, 128, 8, 2),
    (300, 512, 256, 64, 6),
    (2048, 256, 128, 4, 2),
]


@pytest.mark.parametrize(("t", "d", "i", "e", "k"), MOE_SHAPES)
@pytest.mark.parametrize(
    "cfg_name",
    [
        "auto",
        "DECODE",
        "DECODE_WGMMA",
        "PREFILL",
        "mma_k256",
        "wg_k128",
        "mma_words",
        "wg_bytes",
        "mma_words_n32",
        "prefill_cols_pf",
        "prefill_words_k2",
        "prefill_m64",
        *PREFILL_CANDIDATES,
    ],
)
def test_moe_experts_close_to_ref(t, d, i, e, k, cfg_name):
    from deepinfer_kernels.triton import moe as tmoe

    args = moe_inputs(t, d, i, e, k, seed=t + e, neg=t % 2 == 1)
    want = ref_moe.moe_experts(*args, 10.0)
    extra = {
        "mma_k256": tmoe.MoeConfig(16, 64, 64, 4, 4, 4, False, 256),
        "wg_k128": tmoe.MoeConfig(16, 64, 64, 4, 4, 4, True, 128),
        "mma_words": dataclasses.replace(tmoe.DECODE, scale_words=True),
        "wg_bytes": dataclasses.replace(tmoe.DECODE_WGMMA, scale_words=False),
        "mma_words_n32": tmoe.MoeConfig(16, 32, 32, 4, 4, 4, False, 128, scale_words=True),
        # prefill options: 1-D column-fast grid, scale prefetch, a W2 K step of its own
        "prefill_cols_pf": tmoe.MoeConfig(
            128, 64, 128, 8, 8, 3, block_k=64, cols_fast=True, prefetch_scales=True
        ),
        "prefill_words_k2": tmoe.MoeConfig(
            128,
            64,
            64,
            8,
            8,
            3,
            block_k=64,
            cols_fast=True,
            prefetch_scales=True,
            block_k2=128,
            stages2=2,
            scale_words=True,
        ),
        "prefill_m64": tmoe.MoeConfig(
            64, 128, 128, 8, 8, 3, block_k=64, cols_fast=True, prefetch_scales=True
        ),
    }
    if cfg_name in PREFILL_CANDIDATES:
        extra[cfg_name] = _prefill_candidate(cfg_name)
    cfg = None if cfg_name == "auto" else extra.get(cfg_name) or getattr(tmoe, cfg_name)
    poison()
    got = triton_moe_experts(*args, 10.0, config=cfg)
    assert got.dtype == torch.bfloat16
    assert rel(got, want) < 1.5e-2


def test_fp4_scale_words_bitwise():
    """The UE8M0 scales read as bytes or as int32 words give the same bf16 values, in the wgmma
    configuration whose rows are bitwise tile-independent: same outputs bit for bit, real dims."""
    from deepinfer_kernels.triton import moe as tmoe

    args = moe_inputs(9, 5120, 2304, 64, 6, seed=61)
    cfg = tmoe.MoeConfig(16, 64, 64, 4, 4, 4, True, 128)
    outs = [
        triton_moe_experts(*args, 10.0, config=dataclasses.replace(cfg, scale_words=words))
        for words in (False, True)
    ]
    assert torch.equal(outs[0], outs[1])


def test_moe_experts_real_dims_decode():

    args = moe_inputs(24, 5120, 2304, 384, 6, seed=5)
    want = ref_moe.moe_experts(*args, 10.0)
    got = triton_moe_experts(*args, 10.0)
    assert rel(got, want) < 1.5e-2


@pytest.mark.parametrize("prefill", [None, *PREFILL_CANDIDATES])
def test_moe_experts_batch_invariant_bitwise(prefill, monkeypatch):
    """Rows bitwise equal whatever else is in the batch: decode-sized slices (DECODE_WGMMA) and
    prefill-sized ones (PREFILL, or a candidate put in its place) against the full batch."""
    from deepinfer_kernels.triton import moe as tmoe

    if prefill is not None:
        monkeypatch.setattr(tmoe, "PREFILL", _prefill_candidate(prefill))
    x, tw, ids, *ws = moe_inputs(200, 512, 256, 16, 6, seed=21)
    full = triton_moe_experts(x, tw, ids, *ws, 10.0, batch_invariant=True)
    for lo, hi in ((0, 1), (57, 58), (199, 200), (3, 40)):
        part = triton_moe_experts(x[lo:hi], tw[lo:hi], ids[lo:hi], *ws, 10.0, batch_invariant=True)
        assert torch.equal(part, full[lo:hi])


def test_moe_ops_prefill_sizes_dispatch():
    """Prefill-sized routing (pairs > 8 x experts) on the checkpoint's order runs the cuda tier
    in auto mode (its TMA decode kernels up to 16 pairs per expert, then its wgmma prefill
    kernels), and in batch-invariant mode too (its wgmma prefill kernels with the byte exchange;
    test_cuda_moe.py: their bits)."""
    from deepinfer_kernels import REGISTRY, ops

    for t in (40, 200):  # 10 and 50 pairs per expert
        x, tw, ids, *ws = moe_inputs(t, 256, 128, 8, 2, seed=31)
        want = ref_moe.moe_experts(x, tw, ids, *ws, 10.0)
        assert REGISTRY.resolve("moe_experts", x, tw, ids, *ws, 10.0).tier == "cuda"
        assert rel(ops.moe_experts(x, tw, ids, *ws, 10.0), want) < 1.5e-2
        inv = REGISTRY.resolve("moe_experts", x, tw, ids, *ws, 10.0, batch_invariant=True)
        assert inv.tier == "cuda"
        with REGISTRY.batch_invariant_mode():
            assert rel(ops.moe_experts(x, tw, ids, *ws, 10.0), want) < 1.5e-2


def test_act_fake_quant_bf16_is_exact_dequant():
    from deepinfer_kernels.cuda.moe import k_permutation
    from deepinfer_kernels.triton import quant as tq

    x = torch.randn(33, 1280, device=DEV, generator=_gen(41)).bfloat16()
    q, s = ref_quant.act_quant_fp8(x)
    assert torch.equal(tq.act_fake_quant_bf16(x), quant.act_dequant_fp8(q, s, torch.bfloat16))
    rows = torch.randint(0, 33, (200,), device=DEV, generator=_gen(42), dtype=torch.int32)
    gathered = tq.act_fake_quant_bf16(x, rows, permute_k=True)
    assert torch.equal(gathered, tq.act_fake_quant_bf16(x)[rows.long()][:, k_permutation(1280)])


@pytest.mark.parametrize("m", [257, 1000])
def test_fp8_linear_prefill_path_close_to_ref(m):
    x = torch.randn(m, 1024, device=DEV, generator=_gen(m)).bfloat16()
    w, ws = quant.quantize_fp8_blocks(torch.randn(640, 1024, device=DEV, generator=_gen(3)) * 0.02)
    poison()
    got = tri_linear(x, w, ws)
    assert rel(got, ref_linear.fp8_linear(x, w, ws)) < 1e-2


def test_fp8_linear_bf16_activation_path_is_bitwise_fp8_gemm():
    """fp8_linear feeds bf16-expanded activations; fp8_gemm expands x_fp8 per tile: same bits."""
    x = torch.randn(400, 2048, device=DEV, generator=_gen(43)).bfloat16()
    w, ws = quant.quantize_fp8_blocks(torch.randn(512, 2048, device=DEV, generator=_gen(44)))
    xq, xs = quant.act_quant_fp8(x)
    for inv in (True, False):
        lin = tri_linear(x, w, ws, batch_invariant=inv)
        gemm = tri_gemm(xq, xs, w, ws, torch.bfloat16, batch_invariant=inv)
        assert torch.equal(lin, gemm)
    full = tri_linear(x, w, ws, batch_invariant=True)
    for lo, hi in ((0, 1), (399, 400), (10, 74)):
        assert torch.equal(tri_linear(x[lo:hi], w, ws, batch_invariant=True), full[lo:hi])


def test_moe_experts_cuda_graph_replay():
    """The decode path captures in a CUDA graph (no host sync) and replays on new routing."""

    assert_graph_replays_new_routing(triton_moe_experts, 8, 512, 256, 32, 6)


# -- decode (weight-streaming) GEMM ------------------------------------------------------------

DECODE_SHAPES = [(1, 5120, 8192), (3, 40, 64), (16, 2112, 7168), (17, 33, 320), (64, 512, 1280)]


@pytest.mark.parametrize(("m", "n", "k"), DECODE_SHAPES)
@pytest.mark.parametrize(
    "cfg_name",
    [
        "auto",
        "swap64_s4",
        "gemv_n16",
        "gemv_n32_c512",
        "gemv_full",
        "gemv_full_n1_nopf",
    ],
)
def test_decode_gemm_close_to_ref(m, n, k, cfg_name):
    from deepinfer_kernels.triton import gemv

    cfg = {
        "auto": None,
        "swap64_s4": gemv.DecodeConfig(block_m=64, split_k=4),
        "gemv_n16": gemv.DecodeConfig(cuda_core=True, block_n=16, block_k=1024),
        "gemv_n32_c512": gemv.DecodeConfig(cuda_core=True, block_n=32, block_k=512, num_warps=8),
        "gemv_full": gemv.gemv_config(n, k),
        "gemv_full_n1_nopf": gemv.DecodeConfig(
            cuda_core=True, block_n=1, split_k=1, prefetch=False
        ),
    }[cfg_name]
    if cfg is not None and cfg.split_k and (k // 32) % cfg.split_k:
        pytest.skip("split must divide K/32")
    if cfg is not None and cfg.cuda_core and m > gemv.GEMV_MAX_M:
        pytest.skip(f"the CUDA-core kernel takes M <= {gemv.GEMV_MAX_M}")
    xq, xs, w, ws = gemm_inputs(m, n, k, seed=m * 7 + n + k)
    want = ref_linear.fp8_gemm(xq, xs, w, ws, torch.float32)
    poison()
    got = gemv.decode_gemm(xq, xs, w, ws, torch.float32, cfg)
    assert rel(got, want) < 1e-3
    xa = quant.act_dequant_fp8(xq, xs, torch.bfloat16)  # exact: the same products and bits
    assert torch.equal(gemv.decode_gemm(xa, xa, w, ws, torch.float32, cfg), got)
    got16 = gemv.decode_gemm(xq, xs, w, ws.float(), torch.bfloat16, cfg)
    assert rel(got16, want) < 1e-2


@pytest.mark.parametrize(("n", "k"), [(2112, 7168), (5120, 1024), (96, 320), (5120, 8192)])
def test_decode_gemm_batch_invariant_across_paths(n, k):
    """A row's bits are the same at M=1, M=64 and M=301 in invariant mode (the Triton decode
    kernel at M <= 64 and the tiles with its split of K above); in auto mode too where auto runs
    the same kernel (the decode kernel where auto splits K as invariant mode does)."""
    from deepinfer_kernels.ops import linear as linear_ops
    from deepinfer_kernels.triton import gemv

    xq, xs, w, ws = gemm_inputs(301, n, k, seed=n + k)
    full = tri_gemm(xq, xs, w, ws, torch.bfloat16, batch_invariant=True)
    same_split = gemv.decode_split(n, k, False) == gemv.decode_split(n, k, True)
    for lo, hi in ((0, 1), (300, 301), (5, 69), (17, 30), (100, 300), (7, 9)):
        # auto mode at M <= TRITON_GEMV_MAX_M runs the CUDA-core GEMV: other sums, other bits
        auto_same = same_split and linear_ops.TRITON_GEMV_MAX_M < hi - lo <= 64
        for inv in (True, False) if auto_same else (True,):
            part = tri_gemm(xq[lo:hi], xs[lo:hi], w, ws, torch.bfloat16, batch_invariant=inv)
            assert torch.equal(part, full[lo:hi]), (lo, hi, inv)


@pytest.mark.parametrize("m", [1, 4])
def test_decode_gemm_graph_replay(m):
    xq, xs, w, ws = gemm_inputs(m, 2112, 7168, seed=3)
    out = tri_gemm(xq, xs, w, ws, torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri_gemm(xq, xs, w, ws, torch.bfloat16)
    x2, s2, *_ = gemm_inputs(m, 2112, 7168, seed=4)
    xq.copy_(x2)
    xs.copy_(s2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tri_gemm(xq, xs, w, ws, torch.bfloat16))


@pytest.mark.parametrize(
    ("t", "e", "k", "bm"), [(1, 384, 6, 16), (64, 384, 6, 16), (341, 384, 6, 16), (9, 8, 2, 128)]
)
def test_fused_routing_equals_torch_routing(t, e, k, bm):
    from deepinfer_kernels.triton import moe as tmoe

    g = _gen(t + e)
    ids = torch.rand(t, e, device=DEV, generator=g).topk(k, dim=-1).indices
    ids[::5, 0] = -1  # experts on another rank
    tw = torch.rand(t, k, device=DEV, generator=g)
    fused = tmoe.build_routing(tw, ids, e, bm, fused=True)
    plain = tmoe.build_routing(tw, ids, e, bm, fused=False)
    for name in ("sorted_token", "sorted_weight", "tiles", "combine_pos"):
        assert torch.equal(getattr(fused, name), getattr(plain, name)), name
