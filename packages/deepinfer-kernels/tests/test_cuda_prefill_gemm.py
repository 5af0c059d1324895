"""The CUDA FP8 block-scaled prefill GEMM (`cuda/prefill_gemm.py`, `prefill_gemm.cu`).

CPU: the config's checks, the shape and call reasons, and (where NVRTC loads) the kernel compiled
for sm_90a: no local memory, FP8 wgmmas that ptxas does not serialize, one FFMA per accumulator
and slice. GPU (Hopper): against the ref tier at V4.1's shapes, odd M, M and N not multiples of
the tiles, fp32 weight scales and output, rows bitwise independent of the rest of the batch, and
CUDA-graph replay."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from deepinfer_kernels.cuda import module
from deepinfer_kernels.cuda import prefill_gemm as fg
from hypothesis import given, settings
from hypothesis import strategies as st
from sass_checks import unspilled_sass

HAVE_NVRTC = module.nvrtc_reason() is None
needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason=f"{module.nvrtc_reason()}")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not (HOPPER and HAVE_NVRTC), reason="needs a Hopper GPU and NVRTC"
)
CONFIGS = [
    fg.DEFAULT,
    fg.Fp8GemmCudaConfig(block_n=64, stages=6, group_m=4),
    fg.Fp8GemmCudaConfig(stages=2),
    fg.invariant_config(5120, 8192),  # K in 4 chunks, their total in shared memory, 4 stages
    replace(fg.invariant_config(5120, 8192), block_n=64),
    # one CTA per SM over the tiles, their own staging: the stages that fit at the largest K
    fg.config_for(8192, fg.Fp8GemmCudaConfig(persistent=True)),
    fg.config_for(8192, replace(fg.invariant_config(5120, 8192), persistent=True)),
    fg.Fp8GemmCudaConfig(tail_split=4),  # the last partial wave's tiles cut along K
    fg.Fp8GemmCudaConfig(block_n=64, tail_split=3),
    replace(fg.invariant_config(5120, 8192), tail_split=4),  # pieces = the K split's chunks
    replace(fg.invariant_config(5120, 8192), block_n=64, tail_split=2),  # pieces of 2 chunks
]


@settings(max_examples=30, deadline=None)
@given(
    field=st.sampled_from(["block_n", "stages", "group_m", "k_split"]), value=st.integers(-3, 300)
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    allowed = {"block_n": (64, 128), "stages": range(2, 9), "group_m": range(1, 65)}
    ok = allowed.get(field, range(1, 17))
    if value in ok:
        assert getattr(fg.Fp8GemmCudaConfig(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=f"Fp8GemmCudaConfig.{field} must be"):
            fg.Fp8GemmCudaConfig(**{field: value})


def test_config_refuses_floats_and_non_bools():
    with pytest.raises(ValueError, match="stages must be an int"):
        fg.Fp8GemmCudaConfig(stages=5.0)
    with pytest.raises(ValueError, match="persistent must be a bool"):
        fg.Fp8GemmCudaConfig(persistent=1)
    with pytest.raises(ValueError, match=r"tail_split must be 1\.\.8"):
        fg.Fp8GemmCudaConfig(tail_split=9)
    with pytest.raises(ValueError, match="pieces of a cut tile must be whole chunks"):
        fg.Fp8GemmCudaConfig(tail_split=3, k_split=4)
    assert fg.Fp8GemmCudaConfig(tail_split=4, k_split=4).tail_split == 4
    assert fg.Fp8GemmCudaConfig(tail_split=2, k_split=4).tail_split == 2
    with pytest.raises(ValueError, match="needs persistent False"):
        fg.Fp8GemmCudaConfig(tail_split=2, persistent=True)


def test_shape_reasons():
    assert fg.shape_reason(5120, 8192) is None
    assert fg.shape_reason(32768, 1280) is None
    assert "multiple of 128" in fg.shape_reason(5120, 8160)
    assert "multiple of 8" in fg.shape_reason(5124, 8192)
    # the sb table grows with K: fewer stages fit a long K (config_for), and none any K
    assert fg.config_for(8192) == fg.DEFAULT
    assert fg.config_for(1 << 16).stages < fg.DEFAULT.stages
    assert fg.shape_reason(5120, 1 << 16) is None
    assert "over" in fg.shape_reason(5120, 1 << 16, fg.DEFAULT)
    assert "shared memory" in fg.shape_reason(5120, 1 << 20)
    assert "k_split=3" in fg.shape_reason(5120, 1024, fg.Fp8GemmCudaConfig(k_split=3))


def test_batch_invariant_tiles_take_the_fewer_wave_time():
    """Without a tail cut (batch-invariant mode) 64-column tiles exactly where the H200 measured
    them faster (twenty-first session: 5120x8192 and 4608x5120 at M = 512, 7168x2048 at 384), 128
    at the other measured points and at prefill sizes: the width never changes a sum."""
    faster64 = {(5120, 8192, 512), (4608, 5120, 512), (7168, 2048, 384)}
    for n, k in ((5120, 8192), (4608, 5120), (7168, 2048)):
        for m in (256, 384, 512, 2048, 8192):
            cfg = fg.call_config(m, n, k, True)
            assert cfg.k_split == fg.invariant_config(n, k).k_split
            if cfg.tail_split == 1:
                assert cfg.block_n == (64 if (n, k, m) in faster64 else 128), (n, k, m)
            else:  # a cut: its pieces take whole chunks of the K split
                assert cfg.k_split % cfg.tail_split == 0, (n, k, m)
    assert fg.call_config(512, 5120, 8192, True) == replace(
        fg.invariant_config(5120, 8192), tail_split=4
    )


# (N, K, M) -> auto mode's (block_n, tail_split or "p": persistent CTAs): the H200's fastest
# (twenty-second session: a cut where it measured >= 5% faster, 0.48-0.87x the uncut wide tiles;
# twenty-fourth: persistent CTAs past one wave where no cut is, 0.90-0.99x one CTA per tile)
AUTO_PICKS = {
    (5120, 8192, 512): (128, 4),  # 160 tiles: the 28 past one wave in 4 pieces each
    (4608, 5120, 512): (128, 8),
    (4608, 5120, 1024): (128, 5),
    (2112, 7168, 256): (64, 2),  # 66 narrow tiles, every one cut in two: 132 CTAs
    (2112, 7168, 2048): (128, 8),
    (5120, 8192, 384): (128, 1),  # 120 tiles: no room for pieces beside them, one wave
    (5120, 8192, 8192): (128, "p"),  # 19 waves: no cut, the stores overlap the next tile
    (2112, 7168, 8192): (128, "p"),
    (2112, 7168, 1024): (64, "p"),  # 264 narrow tiles: two whole waves
    (7168, 2048, 384): (64, "p"),
    (7168, 2048, 1024): (128, "p"),
    (32768, 1280, 256): (128, "p"),
    (32768, 1280, 8192): (128, "p"),
}


def test_auto_mode_picks_the_measured_fastest():
    for (n, k, m), (block_n, schedule) in AUTO_PICKS.items():
        persistent = schedule == "p"
        want = replace(
            fg.DEFAULT,
            block_n=block_n,
            tail_split=1 if persistent else schedule,
            persistent=persistent,
        )
        assert fg.call_config(m, n, k, False) == fg.config_for(k, want), (n, k, m)
    assert fg.call_config(132 * 128, 128, 8192, False) == fg.DEFAULT  # whole waves
    assert fg.tail_split_for(40, 1280, 132) == 2  # 10 stages: pieces of 4 at least
    assert fg.tail_split_for(5 * 132 + 1, 8192, 132) == 1  # past CUT_MAX_WAVES


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(1, 1 << 15),
    n=st.integers(1, 4096).map(lambda x: 8 * x),
    k=st.integers(1, 128).map(lambda x: 128 * x),
    sms=st.sampled_from([78, 114, 132]),
)
def test_tail_cut_is_modelled_faster_and_fits(m, n, k, sms):
    """Auto mode's config is never modelled slower than batch-invariant mode's tiles without a
    cut; persistent CTAs past one wave only; a cut's pieces (in batch-invariant mode of whole
    chunks of its K split) fit on the SMs the last wave leaves, each of `MIN_PIECE_STAGES`
    stages."""
    auto = fg.call_config(m, n, k, False, sms)
    inv = fg.call_config(m, n, k, True, sms)
    assert fg.call_time(m, n, k, auto.block_n, auto.tail_split, sms, auto.persistent) <= (
        fg.call_time(m, n, k, inv.block_n, 1, sms)
    )
    assert inv.k_split % inv.tail_split == 0  # batch-invariant: pieces of whole chunks
    for cfg in (auto, inv):
        if cfg.persistent:  # only past one wave, and only where its staging fits
            assert fg.tiles_of(m, n, cfg.block_n) > sms
            assert fg.shared_bytes(k, cfg) <= fg.DYNAMIC_SHARED
        if cfg.tail_split > 1:
            tail = fg.tiles_of(m, n, cfg.block_n) % sms
            assert tail * cfg.tail_split <= sms
            assert k // fg.BLOCK_K >= cfg.tail_split * fg.MIN_PIECE_STAGES


def test_invariant_config_is_the_decode_kernels_split():
    """Batch-invariant mode's config cuts K as the TileLang decode kernel does (a function of N
    and K only), with as many stages as fit beside the chunks' total."""
    from deepinfer_kernels.cuda.decode_gemm import k_split

    for n, k in ((5120, 8192), (32768, 1280), (2112, 7168), (1536, 512), (24576, 1536)):
        cfg = fg.invariant_config(n, k)
        assert cfg.k_split == k_split(n, k)
        assert fg.shape_reason(n, k, cfg) is None
        assert fg.shape_reason(n, k, replace(cfg, stages=cfg.stages + 1)) is not None or (
            cfg.stages == fg.DEFAULT.stages
        )
    # the total costs 64 KiB: two stages fewer at V4.1's 5120 x 8192
    assert fg.invariant_config(5120, 8192).stages == fg.DEFAULT.stages - 2
    assert fg.shared_bytes(8192, fg.DEFAULT) == 6 * (16384 + 16384 + 2048) + 256 * 4 * 4 + 1024


def _cpu_call(m=4, n=64, k=128):
    xq = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    xs = torch.ones(m, k // 32)
    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    ws = torch.ones(-(-n // 32), k // 32, dtype=torch.float8_e8m0fnu)
    return xq, xs, w, ws


def test_call_reasons():
    args = _cpu_call()
    assert fg.call_reason(*args, torch.bfloat16) in ("input on cpu", module.nvrtc_reason())
    assert "out_dtype" in fg.call_reason(*args, torch.float16)
    xq, xs, w, ws = args
    assert "x_scale is torch.bfloat16" in fg.call_reason(xq, xs.bfloat16(), w, ws, torch.bfloat16)
    assert "w_scale is torch.int8" in fg.call_reason(xq, xs, w, ws.view(torch.int8), torch.float32)
    wide = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)[:, :128]
    assert "w is not contiguous" in fg.call_reason(xq, xs, wide, ws, torch.bfloat16)
    assert "x_scale must be [4, 4]" in fg.call_reason(xq, xs[:, :2], w, ws, torch.bfloat16)
    assert "w_scale must be [2, 4]" in fg.call_reason(xq, xs, w, ws[:1], torch.bfloat16)
    assert "must share K" in fg.call_reason(xq, xs, w[:, :64], ws, torch.bfloat16)
    assert "float8_e4m3fn" in fg.call_reason(xq.float(), xs, w, ws, torch.bfloat16)
    with pytest.raises(ValueError, match="cuda fp8_gemm: K=96 must be"):
        fg.fp8_gemm(*_cpu_call(k=96), torch.bfloat16)


@needs_nvrtc
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize(("sb_f32", "out_f32"), [(False, False), (True, True)])
def test_kernel_compiles_without_local_memory(cfg, sb_f32, out_f32, tmp_path):
    """No spills; FP8 wgmmas of the tile's N, four per stage; the promotion one FFMA per
    accumulator and slice (4 slices x block_n / 2 accumulators per thread); ptxas keeps the wgmmas
    in flight (its C7514 remark would say that the partials are read inside the pipeline)."""
    cub, log = module.compile_file_and_log(fg.SOURCE, fg.ARCH, fg.defines(cfg, sb_f32, out_f32))
    assert "serialized" not in log, log
    sass = unspilled_sass(cub, tmp_path)
    gmma = re.findall(r"QGMMA\.64x(\d+)x32\.F32\.E4M3\.E4M3", sass)
    assert gmma == [str(cfg.block_n)] * 4
    assert len(re.findall(r"\bFFMA\b", sass)) == 4 * cfg.block_n // 2


# -- GPU ---------------------------------------------------------------------------------------

# (M, N, K): V4.1's prefill N and K, odd M, M and N not multiples of the tiles
SHAPES = [
    (1, 5120, 8192),
    (129, 5120, 8192),
    (1000, 5120, 8192),
    (2049, 32768, 1280),
    (4096, 8192, 5120),
    (300, 200, 256),
    (77, 8, 128),
]


@needs_hopper
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_close_to_ref(m, n, k, cfg):
    from deepinfer_kernels.ref import linear as ref_linear
    from gpu_checks import gemm_inputs, poison, rel

    if cfg.k_split > 1:  # the deepest split of this K up to the config's
        split = max(s for s in range(1, cfg.k_split + 1) if k // fg.BLOCK_K % s == 0)
        tail = max(d for d in range(1, cfg.tail_split + 1) if split % d == 0)
        cfg = replace(cfg, k_split=split, tail_split=tail)
        assert fg.shape_reason(n, k, cfg) is None
    xq, xs, wq, ws = gemm_inputs(m, n, k, seed=m + n + k)
    want = ref_linear.fp8_gemm(xq, xs, wq, ws, torch.float32)
    poison()
    got = fg.fp8_gemm(xq, xs, wq, ws, torch.bfloat16, config=cfg)
    assert got.dtype == torch.bfloat16 and list(got.shape) == [m, n]
    assert rel(got, want) < 1e-2
    poison()
    got = fg.fp8_gemm(xq, xs, wq, ws.float(), torch.float32, config=cfg)
    assert got.dtype == torch.float32 and rel(got, want) < 1e-3


@needs_hopper
def test_rows_do_not_depend_on_the_batch():
    """Without a tail cut (batch-invariant mode's configs) a row's bits do not depend on the
    other rows, whatever the tile width."""
    from gpu_checks import gemm_inputs

    xq, xs, wq, ws = gemm_inputs(700, 5120, 8192, seed=7)
    full = fg.fp8_gemm(xq, xs, wq, ws, config=fg.DEFAULT)
    assert torch.equal(fg.fp8_gemm(xq, xs, wq, ws.float(), config=fg.DEFAULT), full)  # fp32 scales
    for lo, hi in ((0, 1), (1, 8), (5, 300), (299, 700)):
        cfg = fg.call_config(hi - lo, 5120, 8192, False)
        cfg = replace(cfg, tail_split=1)
        assert torch.equal(fg.fp8_gemm(xq[lo:hi], xs[lo:hi], wq, ws, config=cfg), full[lo:hi])


@needs_hopper
@pytest.mark.parametrize("block_n", [64, 128])
def test_tail_pieces_add_in_order(block_n):
    """A cut tile's sums are its pieces' K ranges, each summed as an uncut call over that range
    sums it, added in piece order: bitwise, whichever piece finished last, on every repeat. At 100
    rows 5120 columns are fewer tiles than SMs: every tile is cut."""
    from gpu_checks import gemm_inputs

    m, n, k, split = 100, 5120, 8192, 4
    assert fg.tiles_of(m, n, block_n) < module.sm_count(torch.device("cuda"))
    xq, xs, wq, ws = gemm_inputs(m, n, k, seed=21)
    cut = replace(fg.DEFAULT, block_n=block_n, tail_split=split)
    got = fg.fp8_gemm(xq, xs, wq, ws, torch.float32, config=cut)
    want = None
    step = k // split
    for lo in range(0, k, step):
        part = fg.fp8_gemm(
            xq[:, lo : lo + step].contiguous(),
            xs[:, lo // 32 : (lo + step) // 32].contiguous(),
            wq[:, lo : lo + step].contiguous(),
            ws[:, lo // 32 : (lo + step) // 32].contiguous(),
            torch.float32,
            config=replace(cut, tail_split=1),
        )
        want = part if want is None else want + part
    assert torch.equal(got, want)
    for _ in range(3):
        assert torch.equal(fg.fp8_gemm(xq, xs, wq, ws, torch.float32, config=cut), got)


@needs_hopper
@pytest.mark.parametrize(("m", "n", "k", "pieces"), [(512, 5120, 8192, 4), (256, 2112, 7168, 2)])
def test_batch_invariant_cut_keeps_the_bits(m, n, k, pieces):
    """Batch-invariant mode cuts the last wave's tiles into pieces of its K split's chunks
    (5120x8192 at M = 512: one chunk each; 2112x7168 at M = 256: two, the second piece's kept
    apart): the same bits as the uncut tiles, and through the registry a row's bits are those of
    a call of other M."""
    from deepinfer_kernels import REGISTRY, ops
    from gpu_checks import gemm_inputs

    xq, xs, wq, ws = gemm_inputs(m, n, k, seed=23)
    cut = fg.call_config(m, n, k, True)
    assert cut.k_split == 4 and cut.tail_split == pieces
    got = fg.fp8_gemm(xq, xs, wq, ws, torch.float32, config=cut)
    uncut = replace(cut, tail_split=1)
    assert torch.equal(got, fg.fp8_gemm(xq, xs, wq, ws, torch.float32, config=uncut))
    with REGISTRY.batch_invariant_mode():
        full = ops.fp8_gemm(xq, xs, wq, ws)
        for lo, hi in ((0, 1), (100, 300), (200, m)):
            assert torch.equal(ops.fp8_gemm(xq[lo:hi], xs[lo:hi], wq, ws), full[lo:hi]), (lo, hi)


@needs_hopper
def test_tail_cut_beside_whole_tiles():
    """1000 rows on 5120 columns: 320 tiles, the last 56 cut into 4 pieces (224 CTAs beside the
    264 whole tiles). Close to ref, every element written, and the same bits on every repeat."""
    from deepinfer_kernels.ref import linear as ref_linear
    from gpu_checks import gemm_inputs, poison, rel

    xq, xs, wq, ws = gemm_inputs(1000, 5120, 8192, seed=22)
    want = ref_linear.fp8_gemm(xq, xs, wq, ws, torch.float32)
    cfg = replace(fg.DEFAULT, tail_split=4)
    poison()
    got = fg.fp8_gemm(xq, xs, wq, ws, torch.float32, config=cfg)
    assert rel(got, want) < 1e-3
    for _ in range(3):
        assert torch.equal(fg.fp8_gemm(xq, xs, wq, ws, torch.float32, config=cfg), got)


@needs_hopper
@pytest.mark.parametrize(
    "m", [384, 512]
)  # 512: the tail cut (its pieces' counts zeroed in the graph)
def test_cuda_graph_replay(m):
    from gpu_checks import gemm_inputs

    xq, xs, wq, ws = gemm_inputs(m, 5120, 8192, seed=8)
    eager = fg.fp8_gemm(xq, xs, wq, ws)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fg.fp8_gemm(xq, xs, wq, ws)
    fresh = gemm_inputs(m, 5120, 8192, seed=9)
    for dst, src in zip((xq, xs, wq, ws), fresh, strict=True):
        dst.copy_(src)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fg.fp8_gemm(*fresh))
    assert not torch.equal(out, eager)


@needs_hopper
def test_registry_sends_prefill_here():
    """Prefill M resolves to the cuda tier in both modes (decode M too, on its decode kernel);
    fp8_linear through it matches ref on the same quantised operands."""
    from deepinfer_kernels import REGISTRY, KernelSettings, ops, quant
    from deepinfer_kernels.ref import linear as ref_linear
    from gpu_checks import gemm_inputs, rel

    xq, xs, wq, ws = gemm_inputs(300, 5120, 8192, seed=12)
    x = torch.randn(300, 8192, device="cuda").bfloat16()
    with REGISTRY.configured(KernelSettings(overrides={}, batch_invariant=False)):
        assert REGISTRY.resolve("fp8_gemm", xq, xs, wq, ws, torch.bfloat16).tier == "cuda"
        assert REGISTRY.resolve("fp8_linear", x, wq, ws).tier == "cuda"
        assert REGISTRY.resolve("fp8_linear", x[:64], wq, ws).tier == "cuda"  # decode kernel
        assert REGISTRY.resolve("fp8_linear", x[:150], wq, ws).tier == "cuda"  # its token tiles
        xq2, xs2 = quant.act_quant_fp8(x)
        want = ref_linear.fp8_gemm(xq2, xs2, wq, ws, torch.float32)
        assert rel(ops.fp8_linear(x, wq, ws), want) < 1e-2
        with REGISTRY.batch_invariant_mode():
            kw = {"batch_invariant": True}
            assert REGISTRY.resolve("fp8_linear", x, wq, ws, **kw).tier == "cuda"


@needs_hopper
@pytest.mark.parametrize(("n", "k"), [(5120, 8192), (2112, 7168), (1536, 512)])
def test_invariant_rows_match_the_decode_kernel(n, k):
    """`invariant_config` (the decode kernel's K split) gives the decode kernel's bits, and routed
    in batch-invariant mode a row has the same bits at every M (`gpu_checks`)."""
    from gpu_checks import assert_invariant_prefill_rows, gemm_inputs

    assert_invariant_prefill_rows(fg.fp8_gemm, "cuda", *gemm_inputs(300, n, k, seed=n + k))
