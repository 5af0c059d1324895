"""The TileLang swap-AB decode GEMM (`tilelang/decode_gemm.py`) on the H200 against the ref tier:
fresh random inputs with per-block weight-scale spread, relative-norm errors (fp32 output far
under 1e-3; the FP8 wgmma's own accumulation of 32 products is the only rounding besides fp32
sums), every output element written (NaN-poisoned memory), M not a multiple of the token tile and
N not a multiple of the weight tile, bitwise batch invariance across M (token tiles 16 / 32 / 64),
CUDA-graph replay, and `triton.linear.fp8_gemm` dispatching to it.

Skipped without a Hopper GPU or without tilelang. Each (N, K, split, out dtype, config) compiles
once per process (a few seconds; TILELANG_CACHE_DIR may hold them compiled beforehand)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels import quant
from deepinfer_kernels.ref import linear as ref_linear

DEV = "cuda"
_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [
    pytest.mark.skipif(not _hopper, reason="needs a Hopper GPU (sm_90a wgmma)"),
    pytest.mark.skipif(
        importlib.util.find_spec("tilelang") is None, reason="tilelang is not importable"
    ),
]


def _poison() -> None:
    """Fill the allocator's free blocks with NaN so an unwritten output element shows up."""
    torch.cuda.synchronize()
    blocks = [torch.full((1 << 24,), float("nan"), device=DEV) for _ in range(8)]
    del blocks


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in output: an element was not written"
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _inputs(m: int, n: int, k: int, seed: int):
    """Activations with per-row magnitudes; 32x32 weight blocks whose magnitudes differ by up to
    2**+-6, so that a kernel reading the wrong weight or activation scale shows."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g) * torch.exp(
        torch.randn(m, 1, device=DEV, generator=g)
    )
    spread = torch.randint(-6, 7, (-(-n // 32), k // 32), device=DEV, generator=g).float().exp2()
    spread = spread.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)
    w, ws = quant.quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.02 * spread)
    xq, xs = quant.act_quant_fp8(x)
    return xq, xs, w, ws


def _dg():
    from deepinfer_kernels.tilelang import decode_gemm as dg

    return dg


# (M, N, K): the dense decode shapes of V4.1 (split K), an N tail inside a weight tile (N=200,
# split 1: the output written directly), two token tiles with a tail (M=77)
SHAPES = [(1, 5120, 8192), (13, 2112, 7168), (64, 512, 1280), (3, 200, 256), (77, 200, 256)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_decode_tilelang_close_to_ref(m, n, k):
    dg = _dg()
    xq, xs, w, ws = _inputs(m, n, k, seed=m + n + k)
    want = ref_linear.fp8_gemm(xq, xs, w, ws, torch.float32)
    _poison()
    got = dg.decode_gemm(xq, xs, w, ws, torch.float32)
    assert got.shape == (m, n)
    assert _rel(got, want) < 1e-4
    if n == 200 and m == 3:  # the bf16 store of the split-1 path, fp32 weight scales
        got16 = dg.decode_gemm(xq, xs, w, ws.float(), torch.bfloat16)
        assert got16.dtype == torch.bfloat16
        assert _rel(got16, want) < 1e-2


@pytest.mark.parametrize(
    "cfg_name", ["row_swizzle", "one_cta_per_sm", "n128_t32", "split8_t64", "t8_st4_mb4"]
)
def test_decode_tilelang_variants_close_to_ref(cfg_name):
    """The bench's candidate configurations compute the same function (5120x8192, M=16)."""
    dg = _dg()
    cfg = {
        "row_swizzle": dg.DecodeTileConfig(row_swizzle=True),
        "one_cta_per_sm": dg.DecodeTileConfig(min_blocks=1),
        "n128_t32": dg.DecodeTileConfig(block_n=128, block_t=32),
        "split8_t64": dg.DecodeTileConfig(block_t=64, split_k=8, num_stages=4, min_blocks=3),
        "t8_st4_mb4": dg.DecodeTileConfig(block_t=8, num_stages=4, min_blocks=4),
    }[cfg_name]
    m = 8 if cfg.block_t == 8 else 16
    xq, xs, w, ws = _inputs(m, 5120, 8192, seed=11)
    want = ref_linear.fp8_gemm(xq, xs, w, ws, torch.float32)
    _poison()
    assert _rel(dg.decode_gemm(xq, xs, w, ws, torch.float32, cfg), want) < 1e-4


@pytest.mark.parametrize(("n", "k"), [(2112, 7168), (5120, 8192)])
def test_decode_tilelang_batch_invariant_bitwise(n, k):
    """A row's bits do not depend on M: slices of a 77-row call (token tiles of 64) equal the same
    rows computed alone at M=1 / 2 / 13 (tiles of 16) / 30 (tiles of 32) / 64."""
    dg = _dg()
    xq, xs, w, ws = _inputs(77, n, k, seed=n + k)
    full = dg.decode_gemm(xq, xs, w, ws, torch.bfloat16)
    for lo, hi in ((0, 1), (76, 77), (5, 7), (3, 16), (40, 70), (10, 74)):
        part = dg.decode_gemm(xq[lo:hi], xs[lo:hi], w, ws, torch.bfloat16)
        assert torch.equal(part, full[lo:hi]), (lo, hi)


def test_decode_tilelang_graph_replay():
    dg = _dg()
    xq, xs, w, ws = _inputs(4, 2112, 7168, seed=3)
    out = dg.decode_gemm(xq, xs, w, ws, torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dg.decode_gemm(xq, xs, w, ws, torch.bfloat16)
    x2, s2, *_ = _inputs(4, 2112, 7168, seed=4)
    xq.copy_(x2)
    xs.copy_(s2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dg.decode_gemm(xq, xs, w, ws, torch.bfloat16))


def test_triton_linear_dispatches_to_tilelang_decode(monkeypatch):
    """`triton.linear.fp8_gemm` runs a DecodeTileConfig on the TileLang kernel (bitwise the same
    as calling it); with TILELANG_DECODE_M covering M, auto mode routes fp8_gemm and fp8_linear
    there and invariant mode does not."""
    dg = _dg()
    from deepinfer_kernels.triton import gemv
    from deepinfer_kernels.triton import linear as tl_linear

    xq, xs, w, ws = _inputs(16, 2112, 7168, seed=5)
    cfg = dg.pick_tile_config(16, 2112, 7168)
    direct = dg.decode_gemm(xq, xs, w, ws, torch.bfloat16, cfg)
    assert torch.equal(tl_linear.fp8_gemm(xq, xs, w, ws, torch.bfloat16, config=cfg), direct)
    monkeypatch.setattr(tl_linear, "TILELANG_DECODE_M", (2, 64))
    assert isinstance(tl_linear.pick_config(16, 2112, 7168, False, tilelang_decode=True), type(cfg))
    assert isinstance(
        tl_linear.pick_config(16, 2112, 7168, True, tilelang_decode=True), gemv.DecodeConfig
    )
    assert torch.equal(tl_linear.fp8_gemm(xq, xs, w, ws, torch.bfloat16), direct)
    x = quant.act_dequant_fp8(xq, xs, torch.bfloat16)  # re-quantises to the same xq, xs
    assert torch.equal(tl_linear.fp8_linear(x, w, ws), direct)
    inv = tl_linear.fp8_gemm(xq, xs, w, ws, torch.bfloat16, batch_invariant=True)
    triton_cfg = tl_linear.pick_config(16, 2112, 7168, True)
    assert torch.equal(inv, gemv.decode_gemm(xq, xs, w, ws, torch.bfloat16, triton_cfg))
