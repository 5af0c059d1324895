"""The tilelang fp8_gemm tier on CPU: host-side logic (tile config limits, the weight-scale
layout, the per-tile promotion arithmetic) against float64 math written here, the routing in the
registry, and, when tilelang is importable, the lowered CUDA source for sm_90a (wgmma per K
tile, the promotion, the pipeline's barriers) and, when nvcc is here too, its SASS (QGMMA and
FFMA counts, no spills). Running the kernel needs the H200 (test_gpu_tilelang.py).
Locally: PYTHONPATH=/tmp/devsite_local (tilelang 0.1.15) runs the lowering and SASS tests."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from deepinfer_kernels import REGISTRY, KernelSettings, ops, quant
from deepinfer_kernels.tilelang import fp8_gemm as tg
from hypothesis import given, settings
from hypothesis import strategies as st
from sass_checks import compile_sass, cuda_tools

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None
needs_tilelang = pytest.mark.skipif(
    not HAVE_TILELANG,
    reason="tilelang is not importable here (run with PYTHONPATH=<site with tilelang 0.1.15>)",
)


def _f64_gemm(xq, xs, w, ws_f64) -> torch.Tensor:
    """sum_k xq[m,k] sa[m,k//32] w[n,k] sb[n//32,k//32] with explicit float64 loops over K."""
    m, k = xq.shape
    n = w.shape[0]
    a = xq.double()
    b = w.double()
    out = torch.zeros(m, n, dtype=torch.float64)
    for kk in range(k):
        sa = xs[:, kk // 32].double()  # [m]
        sb = torch.tensor([ws_f64[j // 32][kk // 32] for j in range(n)], dtype=torch.float64)
        out += (a[:, kk] * sa)[:, None] * (b[:, kk] * sb)[None, :]
    return out


def _e8m0_f64(scale: torch.Tensor) -> list[list[float]]:
    """UE8M0 bytes decoded from the bit layout: 2 ** (byte - 127)."""
    return [[2.0 ** (c - 127) for c in row] for row in scale.view(torch.uint8).tolist()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _inputs(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # rows with very different magnitudes, so the per-row, per-32 activation scales differ
    x = torch.randn(m, k, generator=g) * torch.exp(
        2 * torch.randn(m, k // 32, generator=g)
    ).repeat_interleave(32, 1)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    xq, xs = quant.act_quant_fp8(x)
    wq, ws = quant.quantize_fp8_blocks(w)
    return xq, xs, wq, ws


# -- tile configuration limits -------------------------------------------------------------------


def test_default_config_fits_hopper():
    cfg = tg.DEFAULT_CONFIG
    assert cfg.sa_col_major and cfg.n_split == 1
    assert cfg.threads == 256  # two consumer warpgroups (TileLang adds the producer)
    assert cfg.fragment_registers == 3 * 64  # acc + two partials, 64 fp32 each
    # 4 stages x ((128 + 128) x 128 B operands + scales: 128 rows of sa, 4 of sb padded to 8)
    assert cfg.sb_tile_rows == 8
    assert cfg.shared_bytes == 4 * (256 * 128 + (128 + 8) * 4 * 4) <= tg.MAX_SHARED_BYTES


def test_wide_tile_fits_with_split_chunks():
    cfg = tg.TileConfig(block_n=256, n_split=2, depth=1)
    assert cfg.chunk_n == 128 and cfg.fragment_registers == 128 + 64
    assert cfg.shared_bytes == 4 * (384 * 128 + (128 + 8) * 4 * 4) <= tg.MAX_SHARED_BYTES


@pytest.mark.parametrize("block_n", [32, 64, 96, 128, 160, 192])
def test_weight_scale_stage_is_tma_aligned(block_n):
    cfg = tg.TileConfig(block_n=block_n, depth=2 if block_n <= 128 else 1)
    rows = cfg.sb_tile_rows
    assert rows >= block_n // 32 and rows * tg.SLICES * 4 % tg.TMA_SMEM_ALIGN == 0
    assert rows - block_n // 32 < 8  # padded by less than one 128-B unit


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_m": 96}, "block_m"),
        ({"block_n": 48}, "block_n"),
        ({"block_n": 288}, "block_n"),
        ({"num_stages": 0}, "num_stages"),
        ({"block_n": 192, "depth": 2}, "registers"),
        ({"block_n": 256, "depth": 1}, "registers"),
        ({"block_n": 256, "n_split": 2, "depth": 2}, "registers"),
        ({"n_split": 2, "depth": 5}, "registers"),
        ({"depth": 5}, "depth"),
        ({"depth": 0}, "depth"),
        ({"block_n": 128, "n_split": 3}, "n_split"),
        ({"block_n": 96, "n_split": 2}, "n_split"),
        ({"n_split": 0}, "n_split"),
        ({"block_n": 192, "depth": 1, "num_stages": 8}, "shared memory"),
        ({"swizzle_panel": -1}, "swizzle_panel"),
        ({"k_split": 0}, "k_split"),
        ({"k_split": 2}, "registers"),  # acc + total + two 128-wide partials
    ],
)
def test_bad_config_is_value_error(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tg.TileConfig(**kwargs)


# -- host-side layout and arithmetic ---------------------------------------------------------------


@pytest.mark.parametrize("n", [40, 128, 160, 5120, 33])
def test_weight_scale_fp32_values(n):
    k = 256
    _, ws = quant.quantize_fp8_blocks(torch.randn(n, k) * torch.rand(n, 1) * 100)
    sb = tg.weight_scale_fp32(ws, n)
    assert sb.dtype == torch.float32 and list(sb.shape) == [-(-n // 32), k // 32]
    assert sb.double().tolist() == _e8m0_f64(ws)  # exact powers of two
    assert tg.weight_scale_fp32(sb, n) is sb  # fp32 scales pass through without a copy


def test_weight_scale_rejects_wrong_rows():
    _, ws = quant.quantize_fp8_blocks(torch.randn(64, 128))
    with pytest.raises(ValueError, match="w_scale"):
        tg.weight_scale_fp32(ws, 100)


@settings(max_examples=10, deadline=None)
@given(
    m=st.integers(1, 6),
    n=st.integers(1, 100),
    k_tiles=st.integers(1, 2),
    block_n=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 2**31),
)
def test_promote_reference_against_float64(m, n, k_tiles, block_n, seed):
    k = 128 * k_tiles
    xq, xs, wq, ws = _inputs(m, n, k, seed)
    cfg = tg.TileConfig(block_n=block_n)
    got = tg.promote_reference(xq, xs, wq, tg.weight_scale_fp32(ws, n), cfg)
    want = _f64_gemm(xq, xs, wq, _e8m0_f64(ws))
    assert got.dtype == torch.float32 and list(got.shape) == [m, n]
    assert _rel(got, want) < 1e-6


@settings(max_examples=10, deadline=None)
@given(
    m=st.integers(1, 5),
    n=st.integers(1, 70),
    split=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**31),
)
def test_promote_reference_k_split(m, n, split, seed):
    """With k_split chunks: float64 math within fp32 rounding, and exactly the chunks' own
    promote_reference sums added in ascending order (sum_splits' order, in fp32)."""
    k = 128 * split
    xq, xs, wq, ws = _inputs(m, n, k, seed)
    sb = tg.weight_scale_fp32(ws, n)
    cfg = tg.TileConfig(block_n=64, n_split=2, k_split=split)
    got = tg.promote_reference(xq, xs, wq, sb, cfg)
    assert _rel(got, _f64_gemm(xq, xs, wq, _e8m0_f64(ws))) < 1e-6
    one = tg.TileConfig(block_n=64, n_split=2)
    kb = k // 32 // split
    cols = [slice(c * 128, (c + 1) * 128) for c in range(split)]
    blocks = [slice(c * kb, (c + 1) * kb) for c in range(split)]
    chunks = [
        tg.promote_reference(xq[:, ks], xs[:, bs], wq[:, ks], sb[:, bs], one)
        for ks, bs in zip(cols, blocks, strict=True)
    ]
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    assert torch.equal(got, total)


@pytest.mark.parametrize(("n", "k"), [(5120, 8192), (2112, 7168), (32768, 1280), (40, 256)])
def test_invariant_config_uses_the_decode_split(n, k):
    from deepinfer_kernels.tilelang import decode_gemm

    cfg = tg.invariant_config(n, k)
    split = decode_gemm.decode_tile_split(n, k)
    assert cfg.k_split == split and k % (split * tg.BLOCK_K) == 0
    assert cfg.fragment_registers <= tg.MAX_ACC_REGS
    assert cfg == (tg.DEFAULT_CONFIG if split == 1 else cfg)


def test_shape_reason():
    xq, xs, wq, ws = _inputs(3, 40, 128, 0)
    assert tg.shape_reason(xq, xs, wq, ws) is None
    assert tg.shape_reason(xq, xs, wq, ws.float()) is None
    xq96, xs96, wq96, ws96 = _inputs(3, 40, 96, 1)
    assert "multiple of 128" in tg.shape_reason(xq96, xs96, wq96, ws96)
    assert "float32" in tg.shape_reason(xq, xs.double(), wq, ws)
    assert "e4m3" in tg.shape_reason(xq.float(), xs, wq, ws)
    assert "share K" in tg.shape_reason(xq, xs, wq[:, :96], ws)
    assert "x_scale must be" in tg.shape_reason(xq, xs[:, :2], wq, ws)


def test_tma_ready_copies_only_when_needed():
    t = torch.randn(8, 32)
    assert tg.tma_ready(t) is t
    view = t[:, 1:]  # not contiguous
    r = tg.tma_ready(view)
    assert r.is_contiguous() and torch.equal(r, view)
    flat = torch.randn(65)[1:]  # contiguous, 4 bytes off a 16-byte boundary
    r = tg.tma_ready(flat)
    assert r.data_ptr() % 16 == 0 and torch.equal(r, flat)


# -- registry: routing ----------------------------------------------------------------------------


@pytest.fixture
def select_tilelang():
    select = {"fp8_gemm": "tilelang"}
    with REGISTRY.configured(
        KernelSettings(overrides=select, batch_invariant=REGISTRY.batch_invariant)
    ):
        yield


@pytest.mark.parametrize(
    ("op", "check"), [("fp8_gemm", "supports"), ("fp8_linear", "supports_linear")]
)
def test_tiers_are_registered(op, check):
    impl = next(i for i in REGISTRY.implementations(op) if i.tier == "tilelang")
    assert impl.devices == ("cuda",) and impl.requires == ("tilelang",)
    assert impl.target == f"deepinfer_kernels.tilelang.fp8_gemm:{op}"
    assert impl.supports == f"deepinfer_kernels.tilelang.fp8_gemm:{check}"
    tiers = [i.tier for i in REGISTRY.implementations(op)]
    assert tiers.index("tilelang") < tiers.index("triton")  # preferred where it takes the call


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 20000),
    selected=st.booleans(),
    invariant=st.booleans(),
    decode_tl=st.booleans(),
    cap=st.sampled_from([(9, 0), (8, 0), (10, 0), None]),
)
def test_route_reason(rows, selected, invariant, decode_tl, cap):
    why = tg.route_reason(
        "cuda", cap, selected=selected, batch_invariant=invariant, rows=rows, decode_max_m=64,
        invariant_decode_tilelang=decode_tl,
    )  # fmt: skip
    takes = cap == (9, 0) and (selected or (rows > 64 and (decode_tl or not invariant)))
    assert (why is None) == takes
    if cap != (9, 0):
        assert "sm_90a" in why
    elif not takes:
        assert ("M=" in why) if rows <= 64 else ("batch-invariant" in why)
    on_cpu = tg.route_reason(
        "cpu", (9, 0), selected=True, batch_invariant=False, rows=999, decode_max_m=64,
        invariant_decode_tilelang=True,
    )  # fmt: skip
    assert on_cpu == "input on cpu"


def test_cpu_calls_resolve_elsewhere():
    xq, xs, wq, ws = _inputs(300, 64, 128, 3)
    assert tg.supports(xq, xs, wq, ws, torch.bfloat16) == "input on cpu"
    assert REGISTRY.resolve("fp8_gemm", xq, xs, wq, ws, torch.bfloat16).tier == "ref"
    x = torch.randn(300, 128)
    assert tg.supports_linear(x, wq, ws) == "input on cpu"


def test_selected_tier_checks_device_and_shape(select_tilelang):
    xq, xs, wq, ws = _inputs(2, 64, 128, 4)
    assert tg.supports(xq, xs, wq, ws, torch.bfloat16) == "input on cpu"
    with pytest.raises(NotImplementedError, match="tilelang"):
        ops.fp8_gemm(xq, xs, wq, ws)


@pytest.mark.parametrize("m", [1, 3, 4, 129])
def test_activation_scales_layouts(m):
    xs = torch.rand(m, 8) * 4
    assert tg.activation_scales(xs, col_major=False) is xs
    t = tg.activation_scales(xs, col_major=True)
    m4 = -(-m // 4) * 4
    assert list(t.shape) == [8, m4] and t.is_contiguous()
    for i in range(m4):
        for kb in range(8):
            assert t[kb, i].item() == (xs[i, kb].item() if i < m else 0.0)


def test_wrapper_rejects_bad_shapes_before_launch():
    xq, xs, wq, ws = _inputs(2, 64, 96, 5)
    with pytest.raises(ValueError, match="multiple of 128"):
        tg.fp8_gemm(xq, xs, wq, ws)
    xq, xs, wq, ws = _inputs(2, 64, 128, 5)
    with pytest.raises(ValueError, match="out_dtype"):
        tg.fp8_gemm(xq, xs, wq, ws, torch.int32)
    empty = tg.fp8_gemm(xq[:0], xs[:0], wq, ws)  # M = 0: nothing to launch
    assert list(empty.shape) == [0, 64] and empty.dtype == torch.bfloat16


# -- lowering (no GPU, no nvcc) -------------------------------------------------------------


def _consumer_loop(src: str) -> str:
    """The consumer warpgroups' K loop (after setmaxnreg raises their registers)."""
    body = src.split("warpgroup_reg_alloc<", 1)[1]
    return body.split("__sync_thread_partial", 1)[0]


LOWERED_CONFIGS = [
    tg.DEFAULT_CONFIG,
    tg.TileConfig(sa_col_major=False),
    tg.TileConfig(depth=1),
    tg.TileConfig(block_n=256, n_split=2, depth=1),
    tg.TileConfig(n_split=2, depth=4),
    tg.TileConfig(row_swizzle=False),
    tg.TileConfig(row_swizzle=False, block_n=256, n_split=2, depth=1),
    tg.invariant_config(5120, 8192),
    tg.TileConfig(k_split=2, n_split=2, depth=2, early_scales=False),
    tg.TileConfig(k_split=4, depth=1),
    tg.TileConfig(early_scales=False),
    tg.TileConfig(early_scales=False, block_n=256, n_split=2, depth=1),
]


@needs_tilelang
@pytest.mark.parametrize("cfg", LOWERED_CONFIGS, ids=str)
def test_lowered_source_structure(cfg):
    src = tg.lower_source(5120, 8192, "bfloat16", cfg)
    loop = _consumer_loop(src)
    # one m64 x chunk x k32 FP8 wgmma per 32-slice and chunk, from shared memory
    wgmma = re.findall(r"wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, "
                       rf"tl::DataType::kFloat32, 64, {cfg.chunk_n}, 32", loop)  # fmt: skip
    assert len(wgmma) == tg.SLICES * cfg.n_split
    # producer warpgroup + 2 consumers; TMA loads of A, B and both scale tiles
    assert "__launch_bounds__(384, 1)" in src
    assert "warpgroup_reg_dealloc" in src and "warpgroup_reg_alloc<240>" in src
    for desc in ("A_desc", "B_desc", "SA_desc", "SB_desc"):
        assert f"tma_load({desc}" in src
    # promotion: 4 unrolled loops over the thread's 64 accumulator values, each reading sa/sb
    assert loop.count("sa_tile)[") >= 4 and loop.count("sb_tile)[") >= 4
    # register fragments only: accumulator chunk(s) + partial(s), and with early_scales per wgmma
    # in flight a thread's 2 activation-scale rows and its weight scales (one per 32 columns of
    # the chunk); with a K split, a running total per accumulator chunk
    arrays = re.findall(r"^\s*float (\w+)\[(\d+)\];", src, flags=re.M)
    per_chunk = 64 * cfg.chunk_n // 128
    count = cfg.n_split * (2 if cfg.k_split > 1 else 1) + cfg.depth
    scales = [2, cfg.chunk_n // 32] * cfg.depth if cfg.early_scales else []
    assert sorted(int(size) for _, size in arrays) == sorted([per_chunk] * count + scales)
    if cfg.early_scales:  # the first step's scales are read before its wgmma is issued
        head = loop[: loop.index("wgmma")]
        assert "sa_tile)[" in head and "sb_tile)[" in head
    # the oldest of `depth` in-flight wgmmas is promoted under the others, the last depth-1
    # after the full wait
    steps = tg.SLICES * cfg.n_split
    if cfg.depth > 1:
        assert loop.count(f"wait_wgmma<{cfg.depth - 1}>") == steps - cfg.depth + 1
    # no wgmma may still read an operand stage when it is handed back to the producer: the
    # release of A's and B's stage (an arrive on the barrier the producer waits on before that
    # operand's TMA load) comes after a wait for all wgmma groups, with no issue between (the
    # scale stages may go back earlier once their values are in registers: early_scales)
    producer = src.split("warpgroup_reg_dealloc", 1)[1].split("warpgroup_reg_alloc", 1)[0]
    empty = {}
    for before, desc in zip(*[iter(re.split(r"tma_load\((\w+)_desc", producer))] * 2, strict=False):
        empty[desc] = re.findall(r"mbarrier\[([^\]]+)\]\.wait", before)[-1].replace("kt", "kt_1")
    waits_all = [w.end() for w in re.finditer(r"(warpgroup_wait|wait_wgmma)<0>", loop)]
    for desc in ("A", "B"):
        release = loop.index(f"mbarrier[{empty[desc]}].arrive();")
        last_wait_all = max(w for w in waits_all if w < release)
        assert "wgmma_ss<" not in loop[last_wait_all:release]
        assert "wgmma_ss<" not in loop[release:]  # the stage's last wgmma came before it
    # every TMA destination is 128-B aligned in every stage: the buffer's base and the stage
    # stride (a 64-B weight-scale stage once gave "misaligned address" on the H200)
    bases = dict(
        re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src)
    )
    loads = re.findall(r"tma_load\(\w+, mbarrier\[[^\]]+\], \(&\(\(\((\w+)\*\)(\w+)\)"
                       r"\[\(*\(kt & 3\) \* (\d+)\)", src)  # fmt: skip
    assert {buf for _, buf, _ in loads} == {"a_tile", "b_tile", "sa_tile", "sb_tile"}
    elem_bytes = {"fp8_e4_t": 1, "float": 4}
    for ctype, buf, stride in loads:
        assert int(bases[buf]) % tg.TMA_SMEM_ALIGN == 0, buf
        assert int(stride) * elem_bytes[ctype] % tg.TMA_SMEM_ALIGN == 0, (buf, stride)
    # every shared buffer lies inside the shared memory the config accounts for
    offsets = [int(o) for o in re.findall(r"buf_dyn_shmem \+ (\d+)\)", src)]
    assert max(offsets) < cfg.shared_bytes <= tg.MAX_SHARED_BYTES


@needs_tilelang
@pytest.mark.parametrize("n_split", [1, 2])
def test_row_swizzle_lowering(n_split):
    """row_swizzle: one TMA box of 128-B rows per operand and stage, 128-B-swizzle wgmma
    descriptors (layout type 1, 1024-B stride), each slice 32 B further inside the atom, each
    column chunk 64 or 128 rows (x 128 B) further; TileLang's inference is restored after."""
    from tilelang.cuda.op.gemm.gemm_wgmma import GemmWGMMA

    inferred = GemmWGMMA.infer_layout
    cfg = tg.TileConfig(n_split=n_split, depth=2 if n_split == 1 else 3)
    src = tg.lower_source(5120, 8192, "bfloat16", cfg)
    assert GemmWGMMA.infer_layout is inferred
    for desc, buf in (("A_desc", "a_tile"), ("B_desc", "b_tile")):
        loads = re.findall(rf"tma_load\({desc}, [^;]*{buf}\)\[([^\]]*)\]", src)
        assert loads == ["((kt & 3) * 16384)"], loads  # one box per stage, 128 rows x 128 B
    loop = _consumer_loop(src)
    assert "initialize_wgmma_descriptor<3" not in loop
    assert loop.count("initialize_wgmma_descriptor<1, 1, 64>") == 2 * tg.SLICES * n_split
    offsets = re.findall(r"increase_descriptor_offset<int>\(desc_b\w*, \(*\(kt_1 & 3\) \* 16384\)"
                         r"(?: \+ (\d+))?\)", loop)  # fmt: skip
    chunk_bytes = cfg.chunk_n * 128
    want = sorted(s * 32 + h * chunk_bytes for s in range(tg.SLICES) for h in range(n_split))
    assert sorted(int(o or 0) for o in offsets) == want
    plain_cfg = tg.TileConfig(row_swizzle=False, n_split=n_split, depth=cfg.depth)
    plain = tg.lower_source(5120, 8192, "bfloat16", plain_cfg)
    assert "initialize_wgmma_descriptor<3, 1, 16>" in plain  # TileLang's own: 32-B slices


@needs_tilelang
def test_lowered_source_prefill_shapes_and_tails():
    for n, k, out in ((32768, 1280, "bfloat16"), (40, 256, "float32")):
        src = tg.lower_source(n, k, out, tg.DEFAULT_CONFIG)
        assert f"kt_1 < {k // 128}" in src  # K tiles of 128
        assert "int m)" in src  # M is a run-time argument: one kernel per weight shape
        assert "tma_store(C_desc" in src


@needs_tilelang
@pytest.mark.skipif(cuda_tools() is None, reason="needs nvcc and triton's cuobjdump")
@pytest.mark.parametrize(
    "cfg",
    [
        tg.DEFAULT_CONFIG,
        tg.TileConfig(block_n=192, depth=1),
        tg.TileConfig(block_n=256, n_split=2, depth=1),
        tg.TileConfig(row_swizzle=False),
        tg.TileConfig(early_scales=True),
    ],
    ids=str,
)
def test_compiled_sass(cfg, tmp_path):
    """Compile the lowered source as TileLang does (nvcc, sm_90a) and read ptxas' report and the
    SASS: FP8 wgmma (QGMMA) per slice, one FFMA per accumulator value per slice, no local memory."""
    log, ops = compile_sass(tg.lower_source(5120, 8192, "bfloat16", cfg), tmp_path)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
    assert "C7510" not in log  # ptxas did not serialise the wgmma pipeline
    qgmma = [op for op in ops if op.startswith("QGMMA")]
    assert qgmma == [f"QGMMA.64x{cfg.chunk_n}x32.F32.E4M3.E4M3"] * (tg.SLICES * cfg.n_split)
    acc_values = 64 * cfg.block_n // 128  # per thread
    assert sum(op == "FFMA" for op in ops) == tg.SLICES * acc_values
    assert not any(op.startswith(("LDL", "STL")) for op in ops)
