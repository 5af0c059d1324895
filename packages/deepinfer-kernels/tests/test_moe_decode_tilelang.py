"""The TileLang grouped MoE decode GEMM (`tilelang/moe_decode.py`).

CPU: the FP4 -> e4m3 placement (every code, and the kernel's word-at-a-time formula), the torch
reference of the kernel's arithmetic against float64 loops (hypothesis), the host-side checks and
the split policy; with tilelang importable, the lowered CUDA source (wgmma / TMA structure).
GPU (Hopper + tilelang): the kernel against the MoE reference's math (dequantised FP8 x FP4) on
routings from `triton.moe.build_routing`, with empty experts, rows past the tile count and odd T,
every output element written, and CUDA-graph replay.

Locally: PYTHONPATH=<site with tilelang 0.1.15> runs the lowering tests."""

from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch
from deepinfer_kernels import quant
from deepinfer_kernels.tilelang import moe_decode as md
from hypothesis import given, settings
from hypothesis import strategies as st

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None
needs_tilelang = pytest.mark.skipif(
    not HAVE_TILELANG, reason="tilelang is not importable here (PYTHONPATH=<site with tilelang>)"
)
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not (HOPPER and HAVE_TILELANG), reason="needs a Hopper GPU (sm_90a wgmma) and tilelang"
)

# e2m1 magnitudes by code (OCP MX spec), written out here independently of quant.e2m1_value
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def e4m3_bits_to_float(b: int) -> float:
    """e4m3 (fn) bit pattern -> value, by the format's definition (bias 7, subnormals)."""
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    if e == 0:
        return sign * (m / 8) * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


# -- the e4m3 placement --------------------------------------------------------------------------


def test_every_code_placed_exactly():
    """Each of the 16 codes becomes the e4m3 pattern of e2m1 * 2**-6 (signs and -0 included)."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).view(torch.int8)
    got = md.expand_e4m3_bytes(packed).tolist()
    for c in range(16):
        assert e4m3_bits_to_float(got[c]) == e2m1(c) * 2.0**-6
        assert (got[c] >> 7) == (c >> 3)  # -0 keeps its sign
    # and torch's own e4m3 reading of the bytes agrees
    as_fp8 = md.expand_e4m3_bytes(packed).view(torch.float8_e4m3fn).double().tolist()
    assert as_fp8 == [e2m1(c) * 2.0**-6 for c in range(16)]


def byte_perm(x: int, y: int, sel: int) -> int:
    """CUDA's __byte_perm (PRMT): result byte n is byte (sel >> 4n) & 7 of the 8 bytes y:x."""
    both = (y << 32) | x
    return sum(((both >> (8 * ((sel >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def kernel_word_formula(word: int) -> list[int]:
    """The kernel's expansion of one packed int32 word (8 values, low nibble first), as written
    in `build_kernel`: the even values' nibbles (word & 0x0F0F0F0F) and the odd ones'
    ((word >> 4) & 0x0F0F0F0F) placed as (n & 0x07070707) << 2 | (n & 0x08080808) << 4, the two
    placed words interleaved with __byte_perm (selector 0x5140 for bytes 0..3, 0x7362 for 4..7),
    output byte c = byte c % 4 of that."""
    even, odd = word & 0x0F0F0F0F, (word >> 4) & 0x0F0F0F0F

    def place(n: int) -> int:
        return ((n & 0x07070707) << 2) | ((n & 0x08080808) << 4)

    out = []
    for c in range(8):
        pair = byte_perm(place(even), place(odd), 0x5140 + (c // 4) * 0x2222)
        out.append((pair >> ((c % 4) * 8)) & 0xFF)
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_kernel_word_formula_matches_values(word):
    """The word-at-a-time byte placement gives, for value c of the word (nibble c: low nibble of
    byte c // 2 first), the e4m3 of e2m1(nibble) * 2**-6."""
    got = kernel_word_formula(word)
    for c in range(8):
        nib = (word >> (4 * c)) & 0xF
        assert e4m3_bits_to_float(got[c]) == e2m1(nib) * 2.0**-6


# -- the reference of the kernel's arithmetic ----------------------------------------------------


def _case(seed: int, t: int, e: int, n: int, k: int, topk: int):
    """Random FP8 activations and FP4 experts with spread per-row/per-32 scales, and a routing
    as rows (token, expert) in expert order."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-3, 4, (t, k // 32), generator=g).float())
    x = torch.randn(t, k, generator=g) * spread.repeat_interleave(32, 1)
    xq, xs = quant.act_quant_fp8(x)
    w = torch.randn(e, n, k, generator=g) * torch.exp2(
        torch.randint(-6, 7, (e, n, k // 32), generator=g).float()
    ).repeat_interleave(32, 2)
    wq, ws = quant.quantize_fp4_experts(w)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows_token = (order // topk).to(torch.int32)
    rows_expert = flat[order].to(torch.int32)
    return xq, xs, wq, ws, rows_token, rows_expert, ids


def _float64_rows(xq, xs, wq, ws, rows_token, rows_expert):
    """out[r, n] = sum_k x[tok, k] sx[tok, k//32] * e2m1(w[e, n, k]) 2**(u[e, n, k//32] - 127), in
    float64 loops over the 32-slices (values from the formats' definitions)."""
    table = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    p = wq.view(torch.uint8)
    codes = torch.stack((p & 0xF, p >> 4), -1).flatten(-2).long()  # [E, N, K]
    wv = table[codes]
    u = ws.view(torch.uint8).double()
    x64 = xq.double()
    k = xq.shape[1]
    out = torch.zeros(len(rows_token), wq.shape[1], dtype=torch.float64)
    for r, (tok, ex) in enumerate(zip(rows_token.tolist(), rows_expert.tolist(), strict=True)):
        for kb in range(k // 32):
            ks = slice(32 * kb, 32 * kb + 32)
            dot = wv[ex, :, ks] @ x64[tok, ks]
            out[r] += dot * torch.pow(2.0, u[ex, :, kb] - 127) * float(xs[tok, kb])
    return out


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    t=st.integers(1, 5),
    e=st.integers(2, 6),
    n=st.sampled_from([8, 16]),
    kt=st.integers(1, 2),
    split=st.sampled_from([1, 2]),
)
def test_promote_reference_against_float64(seed, t, e, n, kt, split):
    k = 128 * kt * split
    topk = min(2, e)
    xq, xs, wq, ws, rt, re_, _ = _case(seed, t, e, n, k, topk)
    got = md.promote_reference(xq, xs, wq, ws, rt, re_, split).double()
    want = _float64_rows(xq, xs, wq, ws, rt, re_)
    err = ((got - want).norm() / want.norm().clamp_min(1e-300)).item()
    assert err < 1e-6, err
    # the dequantised path (what the GPU test compares the kernel against) agrees as well
    deq = md.dequantized_reference(xq, xs, wq, ws, rt, re_).double()
    assert ((deq - want).norm() / want.norm()).item() < 1e-6


# -- host side -----------------------------------------------------------------------------------


def test_split_policy_is_a_function_of_shapes():
    assert md.moe_decode_split(2304, 5120) == 2  # W1/W3: 6 tiles x 36 x 2 = 432 CTAs
    assert md.moe_decode_split(5120, 2304) == 1  # W2: 6 x 80 = 480 CTAs
    assert md.moe_decode_split(64, 256) == 1  # chunks stay >= 1024 deep


def test_shape_and_config_errors():
    xq, xs, wq, ws, *_ = _case(0, 2, 3, 64, 256, 2)
    assert md.shape_reason(xq, xs, wq, ws) is None
    assert "N must be a multiple of 64" in md.shape_reason(xq, xs, wq[:, :32], ws[:, :32])
    assert "K must be a multiple of 128" in md.shape_reason(
        xq[:, :96], xs[:, :3], wq[:, :, :48], ws[:, :, :3]
    )
    assert "x_fp8 must be float8_e4m3fn" in md.shape_reason(xq.float(), xs, wq, ws)
    assert "w_scale must be" in md.shape_reason(xq, xs, wq, ws[:, :, :4])
    with pytest.raises(ValueError, match="num_stages"):
        md.MoeDecodeConfig(num_stages=0)
    with pytest.raises(ValueError, match="split_k"):
        md.MoeDecodeConfig(split_k=-1)
    with pytest.raises(ValueError, match="min_blocks"):
        md.MoeDecodeConfig(min_blocks=9)
    with pytest.raises(ValueError, match="one_wait with tile_rows=16 needs min_blocks <= 3"):
        md.MoeDecodeConfig(one_wait=True, min_blocks=4)
    with pytest.raises(ValueError, match="tile_rows must be 8 or 16"):
        md.MoeDecodeConfig(tile_rows=32)
    assert md.MoeDecodeConfig(one_wait=True, min_blocks=4, tile_rows=8).tile_rows == 8
    with pytest.raises(ValueError, match="tilelang moe_decode_gemm: w must be"):
        md.moe_decode_gemm(xq, xs, None, wq.float(), ws)
    with pytest.raises(ValueError, match="tiles must be int32"):
        md.grouped_gemm_sorted(xq, xs, torch.zeros(4, 3), wq, ws)
    with pytest.raises(NotImplementedError, match="SwiGLU"):
        md.moe_experts_decode()


# -- lowering (tilelang on CPU) ------------------------------------------------------------------


@needs_tilelang
@pytest.mark.parametrize(
    ("n", "k", "split", "cfg"),
    [
        (2304, 5120, 2, md.MoeDecodeConfig()),
        (5120, 2304, 1, md.MoeDecodeConfig(num_stages=4, min_blocks=2)),
        (2304, 5120, 2, md.MoeDecodeConfig(min_blocks=3, one_wait=True)),
        (2304, 5120, 2, md.MoeDecodeConfig(tile_rows=8)),
        (5120, 2304, 1, md.MoeDecodeConfig(tile_rows=8, one_wait=True)),
    ],
)
def test_lowered_source(n, k, split, cfg):
    src = md.lower_source(n, k, split, "float32" if split > 1 else "bfloat16", cfg)
    assert f"__launch_bounds__(256, {cfg.min_blocks})" in src
    assert "warpgroup_reg_alloc" not in src  # setmaxnreg off at several CTAs per SM
    # one m64 x n(tile rows) x k32 FP8 wgmma per 32-slice, both operands from shared memory
    wgmma = re.findall(r"wgmma_ss<([^>]*)>", src)
    assert wgmma and all(f"64, {cfg.tile_rows}, 32" in w for w in wgmma)
    assert all(
        "kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32" in w for w in wgmma
    )
    # the producer TMAs packed weights, activation rows and their scales; weight scales once
    for desc in ("W_desc", "X_desc", "SX_desc"):
        assert len(re.findall(rf"tma_load\({desc}", src)) == 1, desc
    assert "SW_desc" not in src
    # the expanded tile is written by the consumer threads, so the async proxy (wgmma) must be
    # fenced and the warpgroup synchronised before it reads it
    expand = src.index("252645135")
    between = src[expand : src.index("wgmma_ss", expand)]
    assert "tl::fence_proxy_async();" in between and "__sync_thread_partial" in between
    if not cfg.one_wait:  # each writer fences, then the barrier (HOPPER.md's order)
        assert between.index("fence_proxy_async") < between.index("__sync_thread_partial")
    # tiles past the routing's count exit; the store is bounded by the tile's end row
    assert "if (0 <= expert)" in src
    assert re.search(r"\+ first\) \+ \(i_\d+ & 1\)\) < end\)", src)
    assert f"for (int kt = 0; kt < {k // split // 128}; ++kt)" in src
    # one wait per K tile after the four slices' wgmmas (one_wait), else one after each
    # (T.gemm's own warpgroup_wait)
    if cfg.one_wait:
        loop = src[src.index("for (int kt_1 = 0;") :]
        first_wait = loop.index("wait_wgmma<0>")
        assert loop.count("wait_wgmma<0>") == 1 and "warpgroup_wait" not in src
        assert loop[:first_wait].count("wgmma_ss<") == 4
        # the activation stage goes back to the producer only after the wait
        assert "].arrive();" in loop[first_wait : first_wait + 80]
    else:
        assert "warpgroup_wait<0>" in src and "wait_wgmma" not in src  # in the slice loop


# -- GPU ------------------------------------------------------------------------------------------


def _gpu_case(seed, t, e, n, k, topk, empty_expert=True):
    g = torch.Generator().manual_seed(seed)
    xq, xs, wq, ws, *_ = _case(seed, t, e, n, k, topk)
    scores = torch.rand(t, e, generator=g)
    if empty_expert:
        scores[:, 0] = -1.0  # expert 0 never chosen: an empty expert
    ids = scores.topk(topk, -1).indices
    weights = torch.rand(t, topk, generator=g)
    dev = "cuda"
    return (xq.to(dev), xs.to(dev), wq.to(dev), ws.to(dev), ids.to(dev), weights.to(dev))


@needs_hopper
@pytest.mark.parametrize(
    ("t", "e", "n", "k"),
    # V4.1's W1 at T=1 (K split in 2), one full tile of 16 rows, odd T over few experts (tiles
    # past the real count), many experts with one row each; 3 shapes compiled (a few s each)
    [(1, 16, 2304, 5120), (16, 24, 256, 1024), (37, 8, 128, 512), (5, 384, 128, 512)],
)
def test_gpu_against_moe_reference_math(t, e, n, k):
    from deepinfer_kernels.triton.moe import build_routing

    xq, xs, wq, ws, ids, tw = _gpu_case(t + e + n, t, e, n, k, min(6, e - 1))
    route = build_routing(tw, ids, e, md.TILE_ROWS)
    from gpu_checks import poison

    poison()  # the allocator's free blocks hold NaN: an unwritten output element shows
    got = md.moe_decode_gemm(xq, xs, route, wq, ws, torch.float32)
    rows_expert = torch.repeat_interleave(
        torch.arange(e, device="cuda"), torch.bincount(ids.reshape(-1), minlength=e)
    )
    want = md.dequantized_reference(
        xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), route.sorted_token.cpu(), rows_expert.cpu()
    )
    assert not torch.isnan(got).any(), "an output element was not written"
    # the FP8 wgmma sums each 32-slice's products at less than fp32 precision: H200, the first
    # shape here, 2.5e-5 (one device call); the dense decode kernel's tests allow 1e-4 as well.
    # A wrong scale, row or expert is O(1).
    err = ((got.cpu().double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-4, err
    # the kernel's own arithmetic in torch (same promotion, same split; exact fp32 slices)
    split = md.moe_decode_split(n, k)
    mine = md.promote_reference(
        xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), route.sorted_token.cpu(), rows_expert.cpu(), split
    )
    assert ((got.cpu() - mine).norm() / mine.norm()).item() < 1e-4
    # bf16 output (K split: rounded by the split sum; else by the kernel's store): the fp32
    # result rounded once (one more shape compiled)
    if t in (1, 37):
        got_bf16 = md.moe_decode_gemm(xq, xs, route, wq, ws, torch.bfloat16)
        assert torch.equal(got_bf16, got.to(torch.bfloat16))


@needs_hopper
def test_gpu_one_wait_same_bits():
    """`MoeDecodeConfig.one_wait` (four wgmmas, one wait) gives the default schedule's bits."""
    from deepinfer_kernels.triton.moe import build_routing

    t, e, n, k = 37, 8, 128, 512
    xq, xs, wq, ws, ids, tw = _gpu_case(11, t, e, n, k, 4)
    route = build_routing(tw, ids, e, md.TILE_ROWS)
    want = md.moe_decode_gemm(xq, xs, route, wq, ws, torch.float32)
    cfg = md.MoeDecodeConfig(one_wait=True, min_blocks=3)
    got = md.moe_decode_gemm(xq, xs, route, wq, ws, torch.float32, cfg)
    assert torch.equal(got, want)


@needs_hopper
@pytest.mark.parametrize(
    "cfg",
    [md.MoeDecodeConfig(tile_rows=8), md.MoeDecodeConfig(tile_rows=8, one_wait=True)],
    ids=str,
)
def test_gpu_eight_row_tiles_same_bits(cfg):
    """8-row tiles (`MoeDecodeConfig.tile_rows`, a routing built with block_m=8): the same
    sorted rows (the routing's order does not depend on block_m), and a column's bits do not
    depend on the wgmma's N, so the default's bits. NOT YET RUN ON A GPU."""
    from deepinfer_kernels.triton.moe import build_routing

    t, e, n, k = 37, 8, 128, 512
    xq, xs, wq, ws, ids, tw = _gpu_case(12, t, e, n, k, 4)
    route16 = build_routing(tw, ids, e, md.TILE_ROWS)
    route8 = build_routing(tw, ids, e, 8)
    assert torch.equal(route8.sorted_token, route16.sorted_token)
    want = md.moe_decode_gemm(xq, xs, route16, wq, ws, torch.float32)
    got = md.moe_decode_gemm(xq, xs, route8, wq, ws, torch.float32, cfg)
    assert torch.equal(got, want)


@needs_hopper
def test_gpu_graph_replay_and_invariance():
    """Captured in a CUDA graph and replayed with a new routing in the same buffers; a token's
    rows are bitwise the same when it is routed alone (batch invariance)."""
    from deepinfer_kernels.triton.moe import build_routing

    t, e, n, k, topk = 9, 12, 128, 512, 4
    xq, xs, wq, ws, ids, tw = _gpu_case(5, t, e, n, k, topk, empty_expert=False)
    ids_buf = ids.clone()
    route = build_routing(tw, ids_buf, e, md.TILE_ROWS)
    eager = md.moe_decode_gemm(xq, xs, route, wq, ws, torch.float32)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        md.moe_decode_gemm(xq, xs, build_routing(tw, ids_buf, e, md.TILE_ROWS), wq, ws)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        groute = build_routing(tw, ids_buf, e, md.TILE_ROWS)
        gout = md.moe_decode_gemm(xq, xs, groute, wq, ws, torch.float32)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout, eager)
    ids_buf.copy_(torch.roll(ids, 1, 0))
    graph.replay()
    torch.cuda.synchronize()
    fresh = md.moe_decode_gemm(xq, xs, build_routing(tw, ids_buf, e, md.TILE_ROWS), wq, ws)
    assert torch.equal(gout, fresh)
    # token 3 alone: its rows (in expert order) equal its rows in the batch
    alone = md.moe_decode_gemm(
        xq[3:4], xs[3:4], build_routing(tw[3:4], ids[3:4], e, md.TILE_ROWS), wq, ws
    )
    batch_rows = (route.sorted_token == 3).nonzero().squeeze(1)
    assert torch.equal(alone, eager[batch_rows])
    assert math.isfinite(alone.abs().max().item())
