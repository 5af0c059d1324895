"""The CUDA FP8 decode GEMM (`cuda/decode_gemm.py`, `decode_gemm.cu`).

CPU: the config's checks, token tiles and boxes, the shared-memory and register budgets, the shape
and call reasons, and (where NVRTC loads) every token tile compiled for sm_90a without local
memory, one wgmma per k32 slice (N: the token tile, or at 64 tokens, the tokens as A, the
warpgroup's rows), one FFMA per accumulator and slice, and the scale products and loads. GPU
(Hopper): against the ref tier, rows independent of the batch, CUDA-graph replay, and a
programmatic launch after a kernel that writes its input. Which calls run here: test_routes.py."""

from __future__ import annotations

import re

import pytest
import torch
from deepinfer_kernels.cuda import decode_gemm as dg
from deepinfer_kernels.cuda import module
from hypothesis import given, settings
from hypothesis import strategies as st
from sass_checks import unspilled_sass

HAVE_NVRTC = module.nvrtc_reason() is None
needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason=f"{module.nvrtc_reason()}")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not (HOPPER and HAVE_NVRTC), reason="needs a Hopper GPU and NVRTC"
)
C = dg.DecodeGemmCudaConfig
CONFIGS = [dg.DEFAULT, C(consumers=1, min_blocks=3), C(stages=2), C(programmatic=False)]


@settings(max_examples=30, deadline=None)
@given(field=st.sampled_from(["consumers", "min_blocks", "stages"]), value=st.integers(-3, 40))
def test_config_rejects_bad_values_naming_the_field(field, value):
    allowed = {"consumers": (1, 2), "min_blocks": range(1, 5), "stages": [0, *range(2, 13)]}
    if value in allowed[field]:
        assert getattr(C(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=f"DecodeGemmCudaConfig.{field} must be"):
            C(**{field: value})


def test_config_refuses_floats_and_non_bools():
    with pytest.raises(ValueError, match="stages must be an int"):
        C(stages=4.0)
    with pytest.raises(ValueError, match="programmatic must be a bool"):
        C(programmatic=1)


@settings(max_examples=50, deadline=None)
@given(m=st.integers(1, 300))
def test_token_tile_holds_m(m):
    t = dg.token_tile(m)
    assert t in (8, 16, 32, 64)
    assert t >= min(m, 64) and (t == 8 or t // 2 < m)


@settings(max_examples=50, deadline=None)
@given(m=st.integers(1, 300))
def test_tail_boxes_stop_within_8_rows_of_m(m):
    """The last tile's TMA boxes (the decode kernel's token tiles, the prefill kernel's 128-row
    tiles): whole 8-row groups that hold its rows (the tile when M fills it), so at most 7 rows
    past the tensor are zero-filled per box."""
    for tile in (dg.token_tile(m), 128):
        box, tail_rows = module.tail_box(m, tile), m - (-(-m // tile) - 1) * tile
        assert box % 8 == 0 and 0 < box <= tile
        assert 0 <= box - tail_rows < 8


@settings(max_examples=40, deadline=None)
@given(
    consumers=st.sampled_from([1, 2]),
    min_blocks=st.integers(1, 4),
    tokens=st.sampled_from([8, 16, 32, 64]),
    k_steps=st.integers(1, 128),
    split=st.sampled_from([1, 2, 4, 8]),
)
def test_budgets_fit_the_sm(consumers, min_blocks, tokens, k_steps, split):
    """`min_blocks` CTAs fit one SM's shared memory (each with its 1 KiB reserve and the static
    barriers) and registers (the producer's 24 and the consumers' setmaxnreg within the launch
    allocation) whenever the ring holds 2 stages."""
    cfg = C(consumers=consumers, min_blocks=min_blocks)
    k = k_steps * split * dg.BLOCK_K
    stages = dg.stages_for(tokens, k, split, cfg)
    if stages < 2:
        return
    per_cta = dg.shared_bytes(tokens, k, split, cfg) + dg.STATIC_SHARED
    assert per_cta <= module.MAX_SHARED
    assert min_blocks * (per_cta + 1024) <= dg.SM_SHARED
    launch = min(255, dg.REGS_PER_SM // (cfg.threads * min_blocks)) // 8 * 8
    regs = dg.PRODUCER_REGS * 128 + dg.consumer_regs(cfg) * 128 * consumers
    assert regs <= launch * cfg.threads and dg.consumer_regs(cfg) % 8 == 0


# [N, K] weights the kernel takes, on the H200's SM count or another
WEIGHTS_AND_SMS = dict(
    n=st.integers(1, 8192).map(lambda v: 8 * v),
    k=st.integers(1, 128).map(lambda v: 128 * v),
    sms=st.sampled_from([114, 132]),
)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 300), **WEIGHTS_AND_SMS)
def test_pick_config_keeps_every_cta_resident(m, n, k, sms):
    """Every CTA of the call has a slot at once when the tile's most CTAs per SM hold them (4 for
    64-row tiles, 2 for 128), and the consumers keep at least 64 registers (the fill rule: the
    measured shapes of `TUNED` aside)."""
    cfg = dg.fill_config(m, n, k, sms)
    ctas = -(-n // cfg.rows) * dg.k_split(n, k) * -(-m // dg.token_tile(m))
    most = 4 if cfg.consumers == 1 else 2
    assert ctas <= cfg.min_blocks * sms or cfg.min_blocks == most
    assert cfg.min_blocks >= (3 if cfg.consumers == 1 else 2)
    assert dg.consumer_regs(cfg) >= 64 and cfg.programmatic


def test_shape_reasons():
    assert dg.shape_reason(5120, 8192, 1) is None
    assert dg.shape_reason(5120, 8192, 64) is None
    assert dg.shape_reason(32768, 1280, 16) is None
    assert "multiple of 128" in dg.shape_reason(5120, 8160)
    assert "multiple of 8" in dg.shape_reason(5124, 8192)
    assert dg.k_split(8, 1 << 16) > dg.MAX_SPLIT  # a small N with a long K: more chunks
    assert "portable cluster" in dg.shape_reason(8, 1 << 16)
    assert "2 stages" in dg.shape_reason(5120, 1 << 21, 64, C(min_blocks=4))


def _cpu_call(m=4, n=64, k=128):
    xq = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    xs = torch.ones(m, k // 32)
    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    ws = torch.ones(-(-n // 32), k // 32).to(torch.float8_e8m0fnu)
    return xq, xs, w, ws


def test_call_reasons_name_the_problem():
    xq, xs, w, ws = _cpu_call()
    assert "x_scale must be [4, 4]" in dg.call_reason(xq, xs[:, :2], w, ws, torch.bfloat16)
    assert "out_dtype" in dg.call_reason(xq, xs, w, ws, torch.float16)
    assert "multiple of 8" in dg.call_reason(xq, xs, w[:60], ws, torch.bfloat16)
    assert "input on cpu" in dg.call_reason(xq, xs, w, ws, torch.bfloat16)
    with pytest.raises(ValueError, match=r"cuda decode_gemm: .*w_scale"):
        dg.decode_gemm(xq, xs, w, ws[:1, :1])


@needs_nvrtc
@pytest.mark.parametrize("tokens", [8, 16, 32, 64])
@pytest.mark.parametrize(
    ("cfg", "split"), [(dg.DEFAULT, 4), (C(consumers=1, min_blocks=3), 1), (C(stages=2), 8)]
)
def test_kernel_compiles_without_local_memory(tokens, cfg, split, tmp_path):
    """No spills; one e4m3 wgmma per slice (4 per stage), of the token tile's N (or, with the
    tokens as A at 64, of the warpgroup's 64 rows); the promotion one FFMA per accumulator and
    slice (tokens / 2 accumulators per thread); when `pipelined` (all but the 64-token tiles of
    128-row tiles) the first three slices' waits leave the next slice's wgmma in flight, and
    ptxas serializes none of them; the scale products one FMUL per token and slice (tokens as A:
    4 per slice, 2 tokens x 2 row blocks); the scales of `scale_vec` slices come with one shared
    load (the sw, each of a thread's tokens' sx) per stage or slice (tokens as A: 4 per stage)."""
    stages = dg.stages_for(tokens, 8192, split, cfg)
    cub, log = module.compile_file_and_log(
        dg.SOURCE, dg.ARCH, dg.defines(tokens, split, stages, cfg, False, False)
    )
    assert "serialized" not in log, log
    sass = unspilled_sass(cub, tmp_path)
    assert re.findall(r"QGMMA\.64x(\d+)x32\.F32\.E4M3\.E4M3", sass) == [str(tokens)] * 4
    assert len(re.findall(r"\bFFMA\b", sass)) == 4 * tokens // 2
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", sass)
    assert waits == (["1", "1", "1", "0"] if dg.pipelined(tokens, cfg) else ["0"] * 4)
    assert dg.pipelined(tokens, cfg) == (tokens < 64 or cfg.consumers == 1)
    assert dg.tokens_as_a(tokens) == (tokens == 64)
    as_a = dg.tokens_as_a(tokens)
    assert len(re.findall(r"\bFMUL\b", sass)) == (16 if as_a else tokens)
    scale_loads = 4 if as_a else (1 + tokens // 4) * 4 // dg.scale_vec(tokens)
    assert scale_loads <= len(re.findall(r"\bLDS", sass)) <= scale_loads + 8  # + the epilogue's


def test_shape_reason_checks_the_config_of_the_sm_count():
    """Without a config, the check is of the config the fill rule gives on that many SMs."""
    for sms in (114, 132):
        cfg = dg.fill_config(64, 5120, 8192, sms)
        assert dg.shape_reason(5120, 1 << 21, 64, sms=sms) == dg.shape_reason(
            5120, 1 << 21, 64, cfg
        )
    assert module.sm_count(torch.device("cpu")) == 132


# -- GPU ---------------------------------------------------------------------------------------

# (M, N, K): V4.1's decode N and K (K splits 1..8 by `k_split`), odd M, N not a
# multiple of the tiles, M past one token tile (up to MAX_M, a partial last tile)
SHAPES = [
    (1, 5120, 8192),
    (16, 5120, 8192),
    (33, 2112, 7168),
    (64, 32768, 1280),
    (5, 1536, 512),
    (21, 1536, 512),
    (7, 200, 4096),
    (77, 8, 128),
    (130, 2112, 7168),
    (192, 1536, 512),
    (250, 1280, 5120),
]


@needs_hopper
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_close_to_ref(m, n, k, cfg):
    from deepinfer_kernels.ref import linear as ref_linear
    from gpu_checks import gemm_inputs, poison, rel

    xq, xs, wq, ws = gemm_inputs(m, n, k, seed=m + n + k)
    want = ref_linear.fp8_gemm(xq, xs, wq, ws, torch.float32)
    poison()
    got = dg.decode_gemm(xq, xs, wq, ws, torch.bfloat16, config=cfg)
    assert got.dtype == torch.bfloat16 and list(got.shape) == [m, n]
    assert rel(got, want) < 1e-2
    poison()
    got = dg.decode_gemm(xq, xs, wq, ws.float(), torch.float32, config=cfg)
    assert got.dtype == torch.float32 and rel(got, want) < 1e-3


@needs_hopper
def test_rows_do_not_depend_on_the_batch():
    from gpu_checks import gemm_inputs

    xq, xs, wq, ws = gemm_inputs(200, 5120, 8192, seed=7)
    full = dg.decode_gemm(xq, xs, wq, ws)
    for lo, hi in ((0, 1), (1, 8), (5, 21), (3, 67), (10, 140), (150, 200)):
        assert torch.equal(dg.decode_gemm(xq[lo:hi], xs[lo:hi], wq, ws), full[lo:hi]), (lo, hi)


@needs_hopper
@pytest.mark.parametrize("programmatic", [False, True])
def test_cuda_graph_replay(programmatic):
    from gpu_checks import gemm_inputs

    cfg = C(programmatic=programmatic)
    xq, xs, wq, ws = gemm_inputs(16, 5120, 8192, seed=8)
    eager = dg.decode_gemm(xq, xs, wq, ws, config=cfg)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dg.decode_gemm(xq, xs, wq, ws, config=cfg)
        out2 = dg.decode_gemm(xq, xs, wq, ws, config=cfg)
    fresh = gemm_inputs(16, 5120, 8192, seed=9)
    for dst, src in zip((xq, xs, wq, ws), fresh, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dg.decode_gemm(*fresh))
    assert torch.equal(out2, out)
    assert not torch.equal(out, eager)


@needs_hopper
def test_programmatic_launch_reads_what_the_kernel_before_wrote():
    """The activations are written by the kernel just before (a copy into x's buffer), the
    output's memory was read by it: the programmatic launch waits for both."""
    from gpu_checks import gemm_inputs

    cfg = C(programmatic=True)
    xq, xs, wq, ws = gemm_inputs(32, 5120, 8192, seed=10)
    want = dg.decode_gemm(xq, xs, wq, ws)
    for _ in range(20):
        xq_dst = torch.zeros_like(xq)
        xs_dst = torch.zeros_like(xs)
        torch.cuda.synchronize()
        xq_dst.copy_(xq)
        xs_dst.mul_(0).add_(xs)  # the last kernel before the launch writes the scales
        got = dg.decode_gemm(xq_dst, xs_dst, wq, ws, config=cfg)
        assert torch.equal(got, want)
