"""Checks shared by the GPU test files (METHOD.md): poisoned outputs, relative error."""

from __future__ import annotations

import torch
from deepinfer_kernels import quant


def poison() -> None:
    """Fill the CUDA allocator's free blocks with NaN so an unwritten output element shows up."""
    torch.cuda.synchronize()
    blocks = [torch.full((1 << 24,), float("nan"), device="cuda") for _ in range(8)]
    del blocks


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64; a NaN in `got` (an unwritten element) fails."""
    assert not torch.isnan(got).any(), "NaN in output: an element was not written"
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def gemm_inputs(m: int, n: int, k: int, seed: int):
    """FP8 GEMM operands on CUDA: activations with per-row magnitudes, quantised per 32; 32x32
    weight blocks whose magnitudes differ by up to 2**+-6, so that their UE8M0 scales differ (a
    kernel reading a wrong weight or activation scale shows). -> (xq, xs, w, ws)"""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.exp(
        torch.randn(m, 1, device="cuda", generator=g)
    )
    spread = torch.randint(-6, 7, (-(-n // 32), k // 32), device="cuda", generator=g).float().exp2()
    spread = spread.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)
    w, ws = quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.02 * spread)
    xq, xs = quant.act_quant_fp8(x)
    return xq, xs, w, ws


def moe_inputs(t: int, d: int, i: int, e: int, k: int, seed: int, neg: bool = False):
    """One MoE layer's call on CUDA: x [t, d] bf16, routing weights [t, k], top-k ids (neg: every
    third token's last slot -1, an expert on another rank), random FP4 experts with UE8M0 scales
    2**-9..2**-5. -> (x, tw, ids, w1, s1, w3, s3, w2, s2)"""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()

    def fp4(n, kk):
        packed = torch.randint(
            -128, 128, (e, n, kk // 2), device="cuda", generator=g, dtype=torch.int8
        )
        scale = torch.randint(
            118, 123, (e, n, kk // 32), device="cuda", generator=g, dtype=torch.uint8
        )
        return packed, scale.view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = fp4(i, d), fp4(i, d), fp4(d, i)
    ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
    if neg:
        ids[::3, -1] = -1  # experts held by another rank
    tw = torch.rand(t, k, device="cuda", generator=g)
    return x, tw, ids, w1, s1, w3, s3, w2, s2


def assert_graph_replays_new_routing(fn, t: int, d: int, i: int, e: int, k: int) -> None:
    """`fn(x, tw, ids, *weights, 10.0)` (a MoE experts function) captured in a CUDA graph replays
    two new routings (copied into the captured inputs) bitwise as an eager call does: no host
    sync in the capture, nothing of the first routing baked in."""
    x, tw, ids, *ws = moe_inputs(t, d, i, e, k, seed=51)
    fn(x, tw, ids, *ws, 10.0)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, tw, ids, *ws, 10.0)
    for seed in (52, 53):
        x2, tw2, ids2, *_ = moe_inputs(t, d, i, e, k, seed=seed)
        x.copy_(x2)
        tw.copy_(tw2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fn(x, tw, ids, *ws, 10.0))


def assert_invariant_prefill_rows(gemm, tier: str, xq, xs, wq, ws) -> None:
    """`gemm(..., batch_invariant=True)` (a prefill kernel) gives the cuda decode kernel's bits head
    to head and is close to ref; routed in batch-invariant mode (small M to the decode kernel,
    large M to `tier`) a row has the same bits at every M, through fp8_gemm and fp8_linear."""
    from deepinfer_kernels import REGISTRY, ops
    from deepinfer_kernels.cuda import decode_gemm
    from deepinfer_kernels.ref import linear as ref_linear

    here = gemm(xq, xs, wq, ws, torch.float32, batch_invariant=True)
    assert torch.equal(here, decode_gemm.decode_gemm(xq, xs, wq, ws, torch.float32))
    assert rel(here, ref_linear.fp8_gemm(xq, xs, wq, ws, torch.float32)) < 1e-3
    x = torch.randn(xq.shape[0], xq.shape[1], device="cuda").bfloat16()
    with REGISTRY.batch_invariant_mode():
        kw = {"batch_invariant": True}
        assert REGISTRY.resolve("fp8_gemm", xq, xs, wq, ws, torch.bfloat16, **kw).tier == tier
        full = ops.fp8_gemm(xq, xs, wq, ws)
        full_linear = ops.fp8_linear(x, wq, ws)
        for lo, hi in ((0, 1), (5, 69), (17, 30), (40, 170), (100, 300), (299, 300)):
            assert torch.equal(ops.fp8_gemm(xq[lo:hi], xs[lo:hi], wq, ws), full[lo:hi]), (lo, hi)
            assert torch.equal(ops.fp8_linear(x[lo:hi], wq, ws), full_linear[lo:hi]), (lo, hi)
