"""The TileLang swap-AB decode GEMM on CPU: config limits, the split of K (a function of N and K),
the weight-scale bytes, the kernel's per-chunk promotion arithmetic against float64 loops written
here, the routing in `triton.linear`, and, when tilelang is importable, the lowered CUDA source
for sm_90a (TMA loads per stage, the wgmma shape, launch bounds, the guarded transposed store).
Running the kernel needs the H200 (test_decode_gemm_gpu.py).
Locally: PYTHONPATH=<site with tilelang 0.1.15> runs the lowering tests."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from deepinfer_kernels import quant
from deepinfer_kernels.tilelang import decode_gemm as dg
from hypothesis import given, settings
from hypothesis import strategies as st
from sass_checks import compile_sass, cuda_tools

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None
needs_tilelang = pytest.mark.skipif(
    not HAVE_TILELANG, reason="tilelang is not importable here (PYTHONPATH=<site with tilelang>)"
)


def _inputs(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    spread_x = torch.exp(2 * torch.randn(m, k // 32, generator=g)).repeat_interleave(32, 1)
    x = torch.randn(m, k, generator=g) * spread_x
    spread = torch.randint(-6, 7, (-(-n // 32), k // 32), generator=g).float().exp2()
    spread = spread.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)
    xq, xs = quant.act_quant_fp8(x)
    wq, ws = quant.quantize_fp8_blocks(torch.randn(n, k, generator=g) * spread)
    return xq, xs, wq, ws


def _f64_gemm(xq, xs, w, ws) -> torch.Tensor:
    """sum_k xq[m,k] xs[m,k//32] w[n,k] 2**(byte(ws[n//32,k//32]) - 127), plain float64 loops
    over the scale groups; the weight scale decoded from its bit layout here."""
    m, k = xq.shape
    n = w.shape[0]
    e = ws.view(torch.uint8).tolist()
    out = torch.zeros(m, n, dtype=torch.float64)
    a, b = xq.double(), w.double()
    for kb in range(k // 32):
        sw = torch.tensor([2.0 ** (e[j // 32][kb] - 127) for j in range(n)], dtype=torch.float64)
        ks = slice(kb * 32, (kb + 1) * 32)
        for mm in range(m):
            prod = (a[mm, ks][None, :] * b[:, ks]).sum(1)  # exact products of e4m3 values
            out[mm] += prod * xs[mm, kb].double() * sw
    return out


def test_config_limits():
    with pytest.raises(ValueError, match="block_n"):
        dg.DecodeTileConfig(block_n=96)
    with pytest.raises(ValueError, match="block_t"):
        dg.DecodeTileConfig(block_t=24)
    with pytest.raises(ValueError, match="num_stages"):
        dg.DecodeTileConfig(num_stages=0)
    with pytest.raises(ValueError, match="min_blocks"):
        dg.DecodeTileConfig(min_blocks=9)
    with pytest.raises(ValueError, match="split_k"):
        dg.DecodeTileConfig(split_k=-1)
    with pytest.raises(ValueError, match="depth"):
        dg.DecodeTileConfig(depth=3)
    with pytest.raises(ValueError, match="consumer_regs"):
        dg.DecodeTileConfig(consumer_regs=100)  # not a multiple of 8
    with pytest.raises(ValueError, match="consumer_regs"):
        dg.DecodeTileConfig(block_n=128, consumer_regs=136)
    with pytest.raises(ValueError, match="registers per SM"):
        dg.DecodeTileConfig(min_blocks=4, consumer_regs=136)  # 4 x 128 x (24 + 136) > 65536
    assert dg.DecodeTileConfig(min_blocks=4, consumer_regs=104).consumer_regs == 104
    with pytest.raises(ValueError, match="token_groups"):
        dg.DecodeTileConfig(token_groups=3)
    with pytest.raises(ValueError, match="token_groups"):
        dg.DecodeTileConfig(block_n=128, token_groups=2)
    with pytest.raises(ValueError, match="token_groups"):
        dg.DecodeTileConfig(block_t=8, token_groups=2)
    assert dg.DecodeTileConfig(block_t=64, token_groups=2).threads == 256
    assert dg.DecodeTileConfig(block_n=128).threads == 256


# Each field's allowed values (the kernel's limits, written out here, within the drawn range
# [-300, 300]) and how the error states them.
FIELD_LIMITS = {
    "block_n": ("64 or 128", {64, 128}),
    "block_t": ("one of 8, 16, 32, 64", {8, 16, 32, 64}),
    "split_k": (">= 0", set(range(0, 301))),
    "num_stages": ("in [1, 12]", set(range(1, 13))),
    "min_blocks": ("in [1, 8]", set(range(1, 9))),
    "depth": ("1 or 2", {1, 2}),
    "consumer_regs": ("0 or a multiple of 8 in [64, 240]", {0, *range(64, 241, 8)}),
    "token_groups": ("1 or 2", {1, 2}),
}


@given(field=st.sampled_from(sorted(FIELD_LIMITS)), data=st.data())
@settings(max_examples=120, deadline=None)
def test_config_field_limits(field, data):
    """A value outside a field's limits (the other fields at their defaults) is a ValueError that
    names the field, the allowed values and the value; every allowed value is taken (at one CTA
    per SM, where any consumer_regs fits the register file)."""
    phrase, allowed = FIELD_LIMITS[field]
    bad = data.draw(st.integers(-300, 300).filter(lambda v: v not in allowed), label="bad")
    with pytest.raises(ValueError) as err:
        dg.DecodeTileConfig(**{field: bad})
    assert str(err.value) == f"DecodeTileConfig.{field} must be {phrase}, got {bad}"
    good = data.draw(st.sampled_from(sorted(allowed)), label="good")
    others = {"min_blocks": 1} if field == "consumer_regs" else {}
    assert getattr(dg.DecodeTileConfig(**{field: good}, **others), field) == good


@given(
    n=st.sampled_from([32, 200, 512, 2112, 5120, 32768]),
    kt=st.integers(1, 128),
)
@settings(max_examples=60, deadline=None)
def test_split_depends_on_n_k_only_and_cuts_whole_stages(n, kt):
    k = kt * dg.BLOCK_K
    s = dg.decode_tile_split(n, k)
    assert s >= 1 and k % (s * dg.BLOCK_K) == 0
    assert s == 1 or k // s >= 1024
    # doubling stops once there are >= 2 CTAs per SM (or K cannot be cut further)
    assert s == 1 or -(-n // 64) * (s // 2) < 2 * dg.NUM_SMS
    for m in (1, 7, 16, 33, 64):
        assert dg.pick_tile_config(m, n, k).split_k == s


def test_split_of_v41_shapes():
    assert dg.decode_tile_split(5120, 8192) == 4  # 80 weight tiles x 4 = 320 CTAs
    assert dg.decode_tile_split(2112, 7168) == 4  # 7168 / 8 is not whole 128-stages x 2
    assert dg.decode_tile_split(32768, 1280) == 1


def test_token_tile_by_m():
    assert [dg.pick_tile_config(m, 5120, 8192).block_t for m in (1, 16, 17, 32, 33, 64, 300)] == [
        16, 16, 32, 32, 64, 64, 64,
    ]  # fmt: skip


@given(
    m=st.integers(1, 300),
    n=st.sampled_from([32, 200, 512, 2112, 5120, 32768]),
    kt=st.integers(1, 128),
)
@settings(max_examples=60, deadline=None)
def test_picked_schedule_fits_its_ctas_per_sm(m, n, kt):
    """The picked schedule asks for CTAs per SM that its shared memory allows (ring + the chunk's
    weight-scale bytes + the 1 KB the hardware keeps per CTA, within 228 KB per SM) and, with
    setmaxnreg, that the register file allows; 64-token tiles take 4 per SM exactly when there
    are more CTAs than SMs, else two token groups."""
    k = kt * dg.BLOCK_K
    cfg = dg.pick_tile_config(m, n, k)
    chunk = k // cfg.split_k
    assert cfg.min_blocks * (cfg.shared_bytes(chunk) + 1024) <= 228 * 1024
    if cfg.consumer_regs:
        regs = cfg.min_blocks * (128 * dg.PRODUCER_REGS + cfg.threads * cfg.consumer_regs)
        assert regs <= 65536
    if cfg.block_t == 64:
        many = -(-m // 64) * -(-n // 64) * cfg.split_k > dg.NUM_SMS
        assert (cfg.min_blocks == 4) == many
        assert (cfg.token_groups == 2) == (not many)
    else:
        assert (cfg.min_blocks, cfg.num_stages, cfg.depth) == (4, 4, 1)


@given(e=st.lists(st.integers(1, 254), min_size=4, max_size=4))
@settings(max_examples=30, deadline=None)
def test_weight_scale_bytes_from_e8m0_and_fp32(e):
    """The fp32 powers of two give the same UE8M0 bytes as the e8m0 tensor (exponent field)."""
    b = torch.tensor(e, dtype=torch.uint8).reshape(2, 2)
    e8 = b.view(torch.float8_e8m0fnu)
    f32 = torch.tensor([[2.0 ** (v - 127) for v in row] for row in b.tolist()], dtype=torch.float64)
    assert torch.equal(dg.weight_scale_bytes(e8), b)
    assert torch.equal(dg.weight_scale_bytes(f32.float()), b)


@pytest.mark.parametrize(
    ("m", "n", "k", "split"), [(1, 64, 256, 1), (3, 40, 512, 2), (5, 96, 512, 4)]
)
def test_promotion_arithmetic_matches_float64(m, n, k, split):
    xq, xs, w, ws = _inputs(m, n, k, seed=m + n + k + split)
    got = dg.promote_reference(xq, xs, w, ws, split)
    want = _f64_gemm(xq, xs, w, ws)
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < 1e-6
    assert torch.equal(got, dg.promote_reference(xq, xs, w, ws.float(), split))


def test_shape_reason():
    xq, xs, w, ws = _inputs(2, 64, 256, seed=1)
    assert dg.shape_reason(xq, xs, w, ws) is None
    assert "multiple of 128" in dg.shape_reason(xq[:, :96], xs[:, :3], w[:, :96], ws[:, :3])
    assert "x_scale" in dg.shape_reason(xq, xs[:, :4], w, ws)
    assert "w_scale" in dg.shape_reason(xq, xs, w, ws[:, :4])
    assert "float8_e4m3fn" in dg.shape_reason(xq.float(), xs, w, ws)
    with pytest.raises(ValueError, match="tilelang decode_gemm"):
        dg.decode_gemm(xq, xs, w, ws[:, :4])


def test_triton_linear_routing(monkeypatch):
    """pick_config hands out the TileLang tile only when asked (`tilelang_decode`: the caller's
    route picks the call and the kernel can run it), and `tilelang_route` picks in auto mode M
    inside TILELANG_DECODE_M, in invariant mode every M while TILELANG_INVARIANT; CPU inputs are
    never routed there."""
    pytest.importorskip("triton")
    from deepinfer_kernels.triton import gemv
    from deepinfer_kernels.triton import linear as tl_linear

    def pick(m, inv, tilelang=True):
        routed = tilelang and tl_linear.tilelang_route(m, inv)  # as `fp8_gemm` asks
        return tl_linear.pick_config(m, 5120, 8192, inv, tilelang_decode=routed)

    monkeypatch.setattr(tl_linear, "TILELANG_DECODE_M", (2, 64))
    monkeypatch.setattr(tl_linear, "TILELANG_INVARIANT", True)
    assert pick(16, False) == dg.pick_tile_config(16, 5120, 8192)
    assert pick(2, False) == dg.pick_tile_config(2, 5120, 8192)
    assert pick(1, False) == gemv.gemv_config(5120, 8192)  # the CUDA-core GEMV
    assert isinstance(pick(65, False), tl_linear.GemmConfig)
    for m in (1, 16, 300, 8192):  # invariant: one kernel for every M
        assert pick(m, True) == dg.pick_tile_config(m, 5120, 8192)
    assert isinstance(pick(16, False, tilelang=False), gemv.DecodeConfig)
    assert isinstance(pick(16, True, tilelang=False), gemv.DecodeConfig)
    monkeypatch.setattr(tl_linear, "TILELANG_INVARIANT", False)
    assert isinstance(pick(16, True), gemv.DecodeConfig)
    xq, xs, w, ws = _inputs(2, 64, 256, seed=2)
    assert tl_linear.tilelang_decode_reason(xq, xs, w, ws) == "input on cpu"


# -- lowering (tilelang on CPU) --------------------------------------------------------------------


@needs_tilelang
@pytest.mark.parametrize(
    ("cfg", "split"),
    [
        (dg.DecodeTileConfig(), 4),
        (dg.DecodeTileConfig(block_t=64, min_blocks=1), 1),
        (dg.DecodeTileConfig(row_swizzle=False), 4),
        (dg.DecodeTileConfig(fused_sum=True, depth=2), 4),
        (dg.DecodeTileConfig(64, 64, 0, 4, 3, depth=2, consumer_regs=136), 4),
        (dg.DecodeTileConfig(64, 64, 0, 4, 3, depth=2, consumer_regs=72, token_groups=2), 4),
    ],
)
def test_lowered_source(cfg, split):
    src = dg.lower_source(5120, 8192, split, "float32" if split > 1 else "bfloat16", cfg)
    threads = cfg.threads + 128  # TileLang's producer warpgroup
    bounds = f"__launch_bounds__({threads}, {cfg.min_blocks})"
    assert bounds in src if cfg.min_blocks > 1 else f"__launch_bounds__({threads}" in src
    # setmaxnreg at one CTA per SM (24 / 240), or at several with consumer_regs (24 / that)
    assert ("warpgroup_reg_alloc" in src) == (cfg.min_blocks == 1 or cfg.consumer_regs > 0)
    if cfg.consumer_regs:
        assert f"warpgroup_reg_alloc<{cfg.consumer_regs}>" in src
        assert f"warpgroup_reg_dealloc<{dg.PRODUCER_REGS}>" in src
    # one m64 x block_t x k32 FP8 wgmma per 32-slice, no other matrix instruction
    wgmma = re.findall(r"wgmma_ss<([^>]*)>", src)
    assert wgmma and all(f"64, {cfg.block_t // cfg.token_groups}, 32" in w for w in wgmma)
    fp8_fp32 = "kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32"
    assert all(fp8_fp32 in w for w in wgmma)
    # per stage: the weight and activation tiles (4 boxes of 32-B rows, or 1 with row_swizzle)
    # and the activation scales; the weight scales are read once per CTA, not per stage
    boxes = 1 if cfg.row_swizzle else 4
    assert len(re.findall(r"tma_load\(W_desc", src)) == 1
    assert f"for (int i = 0; i < {boxes}; ++i)" in src or boxes == 1
    assert "tma_load(SX_desc" in src and "SW_desc" not in src
    # the transposed store is guarded by the token count (M is dynamic)
    # (with two token groups the bound reads `< (m + 32)`: thread ids start after the producer's)
    assert re.search(r"if \(.*< \(?m[ )]", src)
    # the in-kernel sum: one device-scope acq_rel arrival per thread (memory_order 4), the last
    # arrival of a slot sums every chunk and resets its counter
    assert ("AtomicAddRet" in src) == cfg.fused_sum
    if cfg.fused_sum:
        assert re.search(r"prev = AtomicAddRet\(\(&\(CNT\[.*\]\)\), 1, 4\);", src)
        assert f"if (prev == {split - 1})" in src and "] = 0;" in src
    # depth 2: slice s+1's wgmma in flight while slice s is promoted
    assert ("wait_wgmma<1>" in src) == (cfg.depth == 2)


@needs_tilelang
@pytest.mark.skipif(cuda_tools() is None, reason="needs nvcc and triton's cuobjdump")
@pytest.mark.parametrize(
    "cfg",
    [
        dg.DecodeTileConfig(block_t=64, depth=2),
        dg.DecodeTileConfig(block_t=64, num_stages=4, min_blocks=3),
        dg.DecodeTileConfig(block_t=64, depth=2, num_stages=4, min_blocks=3, consumer_regs=136),
        dg.DecodeTileConfig(block_t=32, num_stages=5, min_blocks=3),
        dg.DecodeTileConfig(block_t=64, num_stages=4, min_blocks=3, token_groups=2),
        dg.pick_tile_config(64, 5120, 8192),
        dg.pick_tile_config(64, 2112, 7168),
    ],
    ids=str,
)
def test_compiled_registers_fit_min_blocks(cfg, tmp_path):
    """Compiled as TileLang compiles it (nvcc, sm_90a): no spills, the launch register count fits
    min_blocks CTAs of (consumer + producer) warpgroups per SM, setmaxnreg present exactly when
    consumer_regs asks for it, and per 128-deep K tile 4 QGMMA and one FFMA per accumulator value
    per slice (the promotion's arithmetic is the same in every schedule)."""
    log, ops = compile_sass(dg.lower_source(5120, 8192, 4, "float32", cfg), tmp_path)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
    assert "C7508" not in log  # ptxas kept the setmaxnreg
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    assert cfg.min_blocks * (cfg.threads + 128) * regs <= 65536, regs
    assert any(op.startswith("USETMAXREG") for op in ops) == (cfg.consumer_regs > 0)
    n_wgmma = cfg.block_t // cfg.token_groups
    assert [op for op in ops if op.startswith("QGMMA")] == [
        f"QGMMA.64x{n_wgmma}x32.F32.E4M3.E4M3"
    ] * dg.SLICES
    assert sum(op == "FFMA" for op in ops) == dg.SLICES * 64 * n_wgmma // 128
    assert not any(op.startswith(("LDL", "STL")) for op in ops)
