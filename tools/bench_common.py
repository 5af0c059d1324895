"""Timing helpers shared by the kernel benchmarks (`bench_kernels.py` and its sections): event
timing through triton.testing.do_bench (median), CUDA-graph replays, rotation over argument sets so
the L2 cache does not serve repeated inputs, and the measured copy ceiling."""

from __future__ import annotations

import torch

FP8_CEILING_TFLOPS = 1495.0


def bench_ms(fn, rep_ms: int = 100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def bench_graphs(fn, arg_sets) -> float:
    """Median time of replaying one CUDA graph per argument set (rotating): the way the engine
    runs decode, without the host's launch overhead."""
    graphs = []
    for args in arg_sets:
        fn(*args)  # compile and warm outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args)
        graphs.append(g)
    return bench_ms(Rotating(lambda g: g.replay(), [(g,) for g in graphs]))


def fp8_weights(n: int, k: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` distinct random [n, k] FP8 weights with their block scales (w, w_scale), on CUDA:
    the sets a benchmark rotates over or chains so the L2 does not serve them."""
    from deepinfer_kernels import quant

    return [
        quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda") * 0.02) for _ in range(count)
    ]


def measure_copy_gbs() -> float:
    """Device-to-device copy of 2 GiB: bytes read + bytes written over the time."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * a.numel() / ms / 1e6


class Rotating:
    """Calls fn(*args_i) cycling over several argument sets (to defeat the L2 cache)."""

    def __init__(self, fn, arg_sets):
        self.fn, self.arg_sets, self.i = fn, arg_sets, 0

    def __call__(self):
        args = self.arg_sets[self.i % len(self.arg_sets)]
        self.i += 1
        return self.fn(*args)


def chain_graph_ms(fn, arg_sets) -> float:
    """The engine's harness: ONE CUDA graph of len(arg_sets) consecutive calls, each on its own
    argument set (its own weights), as a decode step runs one graph over all layers; ms per call
    (replay time / L), so the replay's fixed cost is shared as it is in the engine."""
    for args in arg_sets:
        fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for args in arg_sets:
            fn(*args)
    torch.cuda.synchronize()
    return bench_ms(g.replay) / len(arg_sets)
