"""The one harness of the benchmarks in tools/: timing, ceilings, shared inputs, and the table.

Not run on its own: every `bench_*.py` (and `eplb_report.py`) imports it from the same folder.

Timing (CUDA, except `wall_ms`):
- `bench_ms`: median of `triton.testing.do_bench` (CUDA events around back-to-back calls; 25 ms
  of warm-up, 100 ms of calls). With `Rotating`, the calls cycle over several argument sets so
  the L2 cache does not serve inputs a decode step would read from HBM.
- `bench_graphs`: one CUDA graph per argument set, the replays rotating and timed by `bench_ms`:
  how the engine runs decode, without the host's launch cost.
- `chain_graph_ms`: ONE CUDA graph of L consecutive calls, each on its own argument set, ms per
  call: a decode step is one graph over all layers, so the replay's fixed cost is shared as it
  is in the engine.
- `wall_ms`: host wall clock per call over a run of calls ended by one synchronize (what a Python
  loop pays: the larger of the host's launch time and the device's time); CPU or CUDA.
Ceilings: `measure_copy_gbs` (a device-to-device copy, measured in the run) and
`FP8_CEILING_TFLOPS` (dense FP8 on the H200, DeepGEMM's rate).
Inputs: `fp8_weights` (dense FP8 weights), `moe_layer` / `moe_routings` / `fragment_experts`
(one V4.1 MoE layer of random FP4 experts and routed batches).
Output: `Table` (a markdown table on stdout; its rows as JSON in $OUT/<name>.json when $OUT is
set) and `run`, which measures into a list of rows and prints the table last, also when SIGTERM
(what `timeout` sends) or an error ends the measuring early.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# ---- ceilings ---------------------------------------------------------------------------------

FP8_CEILING_TFLOPS = 1495.0
"""Dense FP8 tensor-core rate of the H200 that DeepGEMM reaches: the `%fp8` columns' 100%."""


def measure_copy_gbs() -> float:
    """Device-to-device copy of 2 GiB: bytes read + bytes written over the median time, GB/s: the
    `%bw` columns' 100%."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * (1 << 31) / ms / 1e6


# ---- timing -----------------------------------------------------------------------------------


def bench_ms(fn: Callable[[], Any], rep_ms: int = 100) -> float:
    """Median ms per call of fn() by triton.testing.do_bench (CUDA events)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


class Rotating:
    """A callable that calls fn(*args_i), cycling over several argument sets (so that the L2
    cache does not serve repeated inputs)."""

    def __init__(self, fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> None:
        self.fn, self.arg_sets, self.i = fn, arg_sets, 0

    def __call__(self) -> Any:
        args = self.arg_sets[self.i % len(self.arg_sets)]
        self.i += 1
        return self.fn(*args)


def bench_graphs(fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> float:
    """Median ms of replaying one CUDA graph of one call per argument set, the graphs rotating."""
    graphs = []
    for args in arg_sets:
        fn(*args)  # compile and warm outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args)
        graphs.append(g)
    return bench_ms(Rotating(lambda g: g.replay(), [(g,) for g in graphs]))


def chain_graph_ms(fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> float:
    """ms per call of ONE CUDA graph of len(arg_sets) consecutive calls, each on its own argument
    set (replay time / L)."""
    for args in arg_sets:
        fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for args in arg_sets:
            fn(*args)
    torch.cuda.synchronize()
    return bench_ms(g.replay) / len(arg_sets)


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def wall_ms(
    fn: Callable[[], Any], iters: int, device: torch.device | str = "cuda", warmup: int = 2
) -> float:
    """Mean host wall-clock ms per call of fn() over `iters` calls after `warmup` calls, the device
    synchronised before the first timed call and after the last."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def device_name(device: torch.device | str = "cuda") -> str:
    """The GPU's name, or "cpu"."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


# ---- inputs -----------------------------------------------------------------------------------


def fp8_weights(n: int, k: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` distinct random [n, k] FP8 weights with their block scales (w, w_scale) on CUDA:
    the sets a benchmark rotates over or chains so that the L2 cache does not serve them."""
    from deepinfer_kernels import quant

    return [
        quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda") * 0.02) for _ in range(count)
    ]


def fp8_weight_bytes(n: int, k: int) -> int:
    """Bytes of an [n, k] FP8 weight and its 32x32 block scales."""
    return n * k + -(-n // 32) * (k // 32)


MOE_D, MOE_I, MOE_E, MOE_K, MOE_LIMIT = 5120, 2304, 384, 6, 10.0
"""One V4.1 MoE layer: hidden size, expert width, routed experts, experts per token, SwiGLU
clamp."""


def moe_layer(g: torch.Generator) -> tuple[tuple[torch.Tensor, ...], int]:
    """Random FP4 experts of one MoE layer on CUDA, (w1, s1, w3, s3, w2, s2) in the checkpoint's
    byte order, and the bytes one expert's three matrices occupy (packed values + UE8M0
    scales)."""
    d, i, e = MOE_D, MOE_I, MOE_E

    def fp4(n: int, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.randint(
            -128, 128, (e, n, kk // 2), device="cuda", generator=g, dtype=torch.int8
        )
        scale = torch.randint(
            118, 123, (e, n, kk // 32), device="cuda", generator=g, dtype=torch.uint8
        )
        return packed, scale.view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = fp4(i, d), fp4(i, d), fp4(d, i)
    return (w1, s1, w3, s3, w2, s2), 3 * (i * d // 2 + i * d // 32)


def fragment_experts(experts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The same experts with w1, w3, w2 in `quant.fp4_fragment_order` (what the model keeps in
    batch-invariant mode, `ops.moe_fragment_order_pays`)."""
    from deepinfer_kernels.quant import fp4_fragment_order as f

    w1, s1, w3, s3, w2, s2 = experts
    return f(w1), s1, f(w3), s3, f(w2), s2


def moe_routings(t: int, n_sets: int, g: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """n_sets random routed batches of t tokens: [(x [t, D] bf16, weights [t, k] fp32, ids [t, k]
    int64)], each token on k distinct uniformly drawn experts."""
    sets = []
    for _ in range(n_sets):
        x = torch.randn(t, MOE_D, device="cuda", generator=g).bfloat16()
        ids = torch.rand(t, MOE_E, device="cuda", generator=g).topk(MOE_K, dim=-1).indices
        sets.append((x, torch.rand(t, MOE_K, device="cuda", generator=g), ids))
    return sets


def active_experts(sets: Sequence[tuple[torch.Tensor, ...]]) -> float:
    """Mean count of distinct experts the routed batches `sets` (from `moe_routings`) read."""
    return sum(int(torch.unique(s[2]).numel()) for s in sets) / len(sets)


# ---- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Col:
    """One column: its header, the row's key or a function of the row giving the cell's value,
    and the format of a number (a format spec: ".3f"; empty for text, left-aligned)."""

    header: str
    value: str | Callable[[dict], Any]
    fmt: str = ""

    def cell(self, row: dict) -> str:
        try:
            v = self.value(row) if callable(self.value) else row.get(self.value)
        except (KeyError, TypeError, ZeroDivisionError):
            v = None  # a derived cell whose inputs the row lacks
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return "-"
        if self.fmt and isinstance(v, (int, float)) and not isinstance(v, bool):
            return format(v, self.fmt)
        return str(v)


class Table:
    """The one table a tool prints: `title` (lines above it), `cols`, rows as dicts. `print`
    writes it as markdown to stdout and, when $OUT is set, the rows as JSON in $OUT/<name>.json
    (with the title and `meta`)."""

    def __init__(self, name: str, cols: Sequence[Col], title: str = "") -> None:
        self.name, self.cols, self.title = name, list(cols), title
        self.meta: dict[str, Any] = {}

    def lines(self, rows: Sequence[dict]) -> list[str]:
        cells = [[c.cell(r) for c in self.cols] for r in rows]
        widths = [
            max([len(c.header), 3, *(len(line[i]) for line in cells)])
            for i, c in enumerate(self.cols)
        ]

        def line(values: Sequence[str]) -> str:
            padded = [
                v.rjust(w) if c.fmt else v.ljust(w)
                for v, w, c in zip(values, widths, self.cols, strict=True)
            ]
            return "| " + " | ".join(padded) + " |"

        rule = [
            ("-" * (w - 1) + ":") if c.fmt else "-" * w
            for w, c in zip(widths, self.cols, strict=True)
        ]
        return [line([c.header for c in self.cols]), line(rule), *(line(v) for v in cells)]

    def print(self, rows: Sequence[dict]) -> None:
        out = os.environ.get("OUT")
        if out:
            path = os.path.join(out, f"{self.name}.json")
            with open(path, "w") as f:
                doc = dict(title=self.title, meta=self.meta, rows=list(rows))
                json.dump(doc, f, indent=1, default=str)
        print()
        if self.title:
            print(self.title)
            print()
        print("\n".join(self.lines(rows)), flush=True)


class Stopped(BaseException):
    """Raised in the measuring by SIGTERM (a BaseException, so that the `except Exception` of a
    row that reports its own failure does not swallow it)."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped


def run(table: Table, measure: Callable[[list[dict]], None]) -> None:
    """measure(rows) appends the table's rows as it measures them; then the table prints, last in
    the output, also when SIGTERM or an error cut the measuring short (a note, or the traceback,
    first). Exits 1 when the measuring did not finish."""
    rows: list[dict] = []
    finished = False
    old = signal.signal(signal.SIGTERM, _stop)
    try:
        measure(rows)
        finished = True
    except Stopped:
        print(f"# {table.name}: stopped by SIGTERM; the table has the rows finished", flush=True)
    except Exception:  # the table of what finished still prints; the error first
        traceback.print_exc()
        sys.stderr.flush()
        print(f"# {table.name}: failed; the table has the rows finished", flush=True)
    finally:
        signal.signal(signal.SIGTERM, old)
    table.print(rows)
    if not finished:
        sys.exit(1)
