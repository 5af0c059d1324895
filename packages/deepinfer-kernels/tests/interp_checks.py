"""Checks of the decode kernels under the Triton interpreter (CPU), run by test_interpreted.py in a
subprocess with TRITON_INTERPRET=1 (Triton reads it at import).

The GEMM checks compare against float64 block loops written here, not the code under test; the
fused MoE routing against the routing's definition (a stable sort by expert, BLOCK_M-row tiles)
written here with plain Python loops."""

from __future__ import annotations

import dataclasses

import torch
from deepinfer_kernels import quant
from deepinfer_kernels.ops import linear as linear_ops
from deepinfer_kernels.triton import gemv
from deepinfer_kernels.triton import linear as tl_linear
from deepinfer_kernels.triton import moe as tmoe
from hypothesis import given, settings
from hypothesis import strategies as st


def gemm_f64(xq, xs, w, ws) -> torch.Tensor:
    """sum_k (xq[m, k] * xs[m, k // 32]) * (w[n, k] * ws[n // 32, k // 32]) in float64 loops over
    32x32 blocks."""
    m, k = xq.shape
    n = w.shape[0]
    out = torch.zeros(m, n, dtype=torch.float64)
    xd = xq.double()
    wd = w.double()
    sx = xs.double()
    sw = ws.float().double()
    for bk in range(0, k, 32):
        a = xd[:, bk : bk + 32] * sx[:, bk // 32 : bk // 32 + 1]
        for bn in range(0, n, 32):
            blk = wd[bn : bn + 32, bk : bk + 32] * sw[bn // 32, bk // 32].item()
            out[:, bn : bn + 32] += a @ blk.t()
    return out


def rel(a, b) -> float:
    assert not torch.isnan(a).any()
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(m, n, k, seed):
    """Activations with per-row magnitudes; a weight whose 32x32 blocks differ in magnitude by
    up to 2**+-6, so that the weight scales differ from block to block (a kernel reading the wrong
    scale shows)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen))
    spread = torch.randint(-6, 7, (-(-n // 32), k // 32), generator=gen).float().exp2()
    spread = spread.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)
    w, ws = quant.quantize_fp8_blocks(torch.randn(n, k, generator=gen) * 0.02 * spread)
    xq, xs = quant.act_quant_fp8(x)
    return xq, xs, w, ws


CONFIGS = [
    gemv.DecodeConfig(),
    gemv.DecodeConfig(block_m=64, block_n=32, block_k=64, split_k=2),
    gemv.DecodeConfig(block_m=32, block_n=64, block_k=32, split_k=3),
    gemv.DecodeConfig(block_k=64, split_k=1),
    gemv.DecodeConfig(block_k=64, split_k=2),
    gemv.DecodeConfig(cuda_core=True, block_n=16, block_k=1024),
    gemv.DecodeConfig(cuda_core=True, block_n=8, block_k=64, num_warps=2),
]


@settings(max_examples=16, deadline=None)
@given(
    m=st.sampled_from([1, 2, 3, 16, 17, 33]),
    n=st.sampled_from([1, 31, 32, 33, 64, 65, 96]),
    kb=st.sampled_from([1, 2, 3, 4, 6, 8, 12]),
    ci=st.integers(0, len(CONFIGS) - 1),
    seed=st.integers(0, 2**31),
)
def check_decode_gemm_against_float64(m, n, kb, ci, seed):
    k = 32 * kb
    cfg = CONFIGS[ci]
    if cfg.split_k and kb % cfg.split_k:
        cfg = dataclasses.replace(cfg, split_k=1)
    if cfg.cuda_core and m > gemv.GEMV_MAX_M:
        m = 1 + m % gemv.GEMV_MAX_M
    xq, xs, w, ws = inputs(m, n, k, seed)
    want = gemm_f64(xq, xs, w, ws)
    got = gemv.decode_gemm(xq, xs, w, ws, torch.float32, cfg)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert rel(got, want) < 1e-5, (m, n, k, cfg)
    xa = quant.act_dequant_fp8(xq, xs, torch.bfloat16)  # the same products: the same bits
    assert torch.equal(gemv.decode_gemm(xa, xa, w, ws, torch.float32, cfg), got)
    got_f32_scale = gemv.decode_gemm(xq, xs, w, ws.float(), torch.bfloat16, cfg)
    assert got_f32_scale.dtype == torch.bfloat16 and rel(got_f32_scale, want) < 1e-2


def check_steps_and_cuda_core():
    """K steps of 1, 2, 4 groups with splits starting mid-step (K/32 = 8, 12, 40), and the
    CUDA-core kernel's chunks (K = 1280 takes 256-wide chunks, split 5), against float64; M = 0
    and M above its limit."""
    for m, n, k, bk, split in ((2, 65, 256, 32, 8), (1, 40, 384, 64, 3), (3, 96, 1280, 128, 5)):
        xq, xs, w, ws = inputs(m, n, k, seed=k + bk)
        want = gemm_f64(xq, xs, w, ws)
        cfg = gemv.DecodeConfig(block_k=bk, split_k=split)
        assert rel(gemv.decode_gemm(xq, xs, w, ws, torch.float32, cfg), want) < 1e-5
        cc = gemv.DecodeConfig(cuda_core=True, block_n=32, block_k=1024)
        got = gemv.decode_gemm(xq, xs, w, ws, torch.float32, cc)
        assert rel(got, want) < 1e-5
        xa = quant.act_dequant_fp8(xq, xs, torch.bfloat16)
        assert rel(gemv.decode_gemm(xa, xa, w, ws, torch.float32, cc), want) < 1e-5
    # the whole of K per program (split_k=1): K/32 a power of two or padded and masked (3, 40);
    # rows per program 1 / 4 / 32; and what fp8_gemm picks at M=1 in auto mode (that kernel)
    for m, n, k, rows in ((1, 33, 96, 1), (2, 70, 1280, 4), (1, 64, 2048, 32), (4, 8, 32, 4)):
        xq, xs, w, ws = inputs(m, n, k, seed=n + k)
        want = gemm_f64(xq, xs, w, ws)
        full = gemv.DecodeConfig(cuda_core=True, block_n=rows, split_k=1)
        got = gemv.decode_gemm(xq, xs, w, ws, torch.float32, full)
        assert rel(got, want) < 1e-5, (m, n, k, rows)
        if m == 1:
            plan = linear_ops.triton_plan("fp8_gemm", 1, n, k, False)
            assert plan.config == gemv.gemv_config(n, k)
            auto = tl_linear.fp8_gemm(xq, xs, w, ws, torch.float32, config=plan.config)
            assert rel(auto, want) < 1e-5
    assert gemv.gemv_config(5120, 8192) == gemv.DecodeConfig(block_n=2, split_k=1, cuda_core=True)
    assert gemv.gemv_config(32768, 1280).block_n == 4
    assert gemv.gemv_config(5120, 65536).block_k == 8192
    assert not linear_ops.triton_plan("fp8_gemm", 1, 5120, 8192, True).config.cuda_core
    xq, xs, w, ws = inputs(0, 32, 64, seed=1)
    cc = gemv.DecodeConfig(cuda_core=True, block_n=16)
    assert gemv.decode_gemm(xq, xs, w, ws, torch.float32, cc).shape == (0, 32)
    try:
        gemv.decode_gemm(*inputs(gemv.GEMV_MAX_M + 1, 32, 64, 0), torch.float32, cc)
    except ValueError as exc:
        assert "cuda_core" in str(exc)
    else:
        raise AssertionError("cuda_core with M > GEMV_MAX_M was accepted")


def check_splits_and_paths():
    # K at split and block boundaries; M = 0; the invariant prefill path with the decode split
    for m, n, k, split in ((5, 40, 96, 3), (1, 33, 1024, 4), (70, 64, 256, 2), (0, 32, 64, 1)):
        xq, xs, w, ws = inputs(m, n, k, seed=m + n + k)
        want = gemm_f64(xq, xs, w, ws)
        got = gemv.decode_gemm(xq, xs, w, ws, torch.float32, gemv.DecodeConfig(split_k=split))
        assert got.shape == (m, n)
        if m:
            assert rel(got, want) < 1e-5
        big = tl_linear.GemmConfig(64, 64, split, 4, 3, block_k=64)
        got_big = tl_linear.fp8_gemm(xq, xs, w, ws, torch.float32, batch_invariant=True, config=big)
        if m:
            assert rel(got_big, want) < 1e-5
    # the fixed-order split sum
    p = torch.randn(3, 4, 5)
    assert torch.equal(gemv.sum_splits(p, torch.float32), (p[0] + p[1]) + p[2])
    # the split policy depends on N and K only and cuts K on scale groups
    assert gemv.decode_split(5120, 8192) == 4
    assert gemv.decode_split(5120, 8192, batch_invariant=False) == 8
    assert gemv.decode_split(512, 7168) == 4
    assert gemv.decode_split(32768, 1280) == 1
    for n in (32, 100, 4096):
        for k in (32, 96, 1280, 7168, 8192):
            for inv in (True, False):
                s = gemv.decode_split(n, k, inv)
                assert (k // 32) % s == 0 and (s == 1 or k // s >= 1024)
    # bad configurations name the field
    for bad, field in (
        ({"block_n": 48}, "block_n"),
        ({"block_k": 48}, "block_k"),
        ({"cuda_core": True, "block_n": 64}, "cuda_core"),
        ({"cuda_core": True, "block_n": 16, "block_k": 96}, "block_k"),
    ):
        try:
            gemv.DecodeConfig(**bad)
        except ValueError as exc:
            assert field in str(exc)
        else:
            raise AssertionError(f"DecodeConfig({bad}) was accepted")
    try:
        gemv.decode_gemm(*inputs(2, 32, 96, 0), torch.float32, gemv.DecodeConfig(split_k=2))
    except ValueError as exc:
        assert "split_k" in str(exc)
    else:
        raise AssertionError("split_k=2 with K/32=3 was accepted")


def routing_loops(ids: list[list[int]], experts: int, block_m: int, max_tiles: int):
    """The routing by definition: pairs (token, slot) in row-major order, stably sorted by
    expert (negative ids last), tiles of block_m rows per expert, each token's rows ascending."""
    k = len(ids[0])
    pairs = [(e if e >= 0 else experts, p) for p, e in enumerate(v for row in ids for v in row)]
    order = [p for _, p in sorted(pairs)]
    where = {p: i for i, p in enumerate(order)}
    tiles, row = [], 0
    for e in range(experts):
        count = sum(1 for key, _ in pairs if key == e)
        for j in range(0, count, block_m):
            tiles.append([e, row + j, row + count])
        row += count
    tiles += [[-1, 0, 0]] * (max_tiles - len(tiles))
    pos = [
        sorted(where[t * k + j] if ids[t][j] >= 0 else len(pairs) for j in range(k))
        for t in range(len(ids))
    ]
    return order, tiles, pos


@settings(max_examples=12, deadline=None)
@given(
    t=st.integers(1, 40),
    k=st.integers(1, 6),
    experts=st.sampled_from([6, 8, 33, 384]),
    block_m=st.sampled_from([16, 64]),
    neg=st.booleans(),
    seed=st.integers(0, 2**31),
)
def check_fused_routing_against_loops(t, k, experts, block_m, neg, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, experts, generator=gen).topk(min(k, experts), dim=-1).indices
    if neg:
        ids[::2, -1] = -1
    tw = torch.rand(ids.shape, generator=gen)
    fused = tmoe.build_routing(tw, ids, experts, block_m, fused=True)
    plain = tmoe.build_routing(tw, ids, experts, block_m, fused=False)
    order, tiles, pos = routing_loops(ids.tolist(), experts, block_m, fused.tiles.shape[0])
    kk = ids.shape[1]
    assert fused.sorted_token.tolist() == [p // kk for p in order]
    assert fused.sorted_weight.tolist() == [tw.view(-1)[p].item() for p in order]
    assert fused.tiles.tolist() == tiles
    assert fused.combine_pos.tolist() == pos
    for name in ("sorted_token", "sorted_weight", "tiles", "combine_pos"):
        a, b = getattr(fused, name), getattr(plain, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


if __name__ == "__main__":
    check_decode_gemm_against_float64()
    check_steps_and_cuda_core()
    check_splits_and_paths()
    check_fused_routing_against_loops()
    print("interpreted decode checks passed")
