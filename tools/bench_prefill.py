"""The dense FP8 GEMM across M in both modes, and a re-measurement of its routing table; one table.

Default: `ops.fp8_gemm` on V4.1's dense weights at M = 256..8192 in auto and in batch-invariant
mode: the plan each mode runs (`ops.linear.plans_for`: the kernel, and for the prefill kernel
its tile width / the last partial wave's cut along K, or `p` for persistent CTAs, and its K
split), us per call, auto mode's TFLOP/s, and invariant mode's time over auto's.

`--routes`: what `ops.linear.ROUTES` decides, measured again. For each of its [N, K] weights
and each `ROUTE_M` bucket (us summed over the bucket's first and last M): the cuda decode kernel
with each config a `ROUTES` digit names (`DECODE_CONFIGS`: 2, 3, 4) and, above 64 tokens (where
the table may send a call to the prefill kernel), the prefill kernel with the config each mode
gives it (`cuda.prefill_gemm.call_config`); then the entry those times give beside the table's:
the fastest digit D, `Dp` where the prefill kernel is faster in auto mode only, `p` where it is
in both, `D?` where only batch-invariant mode's prefill config beats the decode kernel (which
`ROUTES` cannot say); `.` in the table (the fill rule) matches the digits the rule gives.

Timing: one CUDA graph of calls over distinct weights (1 GiB of them, 4 to 16 sets: more than
the L2 holds; `harness.chain_graph_ms`, the engine's harness), best of 3 graphs.

`python tools/bench_prefill.py [--quick] [--routes] [--shapes NxK ...]` on the GPU machine
(--quick: M in 512 / 1024 / 8192; with --routes only the buckets above 64 tokens; --shapes: only
those weights, to split a long run). JSON of the rows in $OUT.
"""

from __future__ import annotations

import argparse

import harness
import torch
from harness import Col, chain_graph_ms

SHAPES = ((5120, 8192), (4608, 5120), (7168, 2048), (2112, 7168), (32768, 1280))
"""V4.1's dense weights [N, K] that prefill runs on the prefill kernel (and V3's wq_a)."""
M_LIST = (256, 384, 512, 640, 768, 1024, 1536, 2048, 4096, 8192)
QUICK_M = (512, 1024, 8192)
ROUNDS = 3
WEIGHT_BYTES = 1 << 30  # distinct weights per graph: more than the L2 holds, at least 4 sets


def weight_sets(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Distinct [N, K] FP8 weights for one graph: `WEIGHT_BYTES` of them, 4 to 16 sets."""
    return harness.fp8_weights(n, k, max(4, min(16, WEIGHT_BYTES // (n * k))))


def us_per_call(fn, weights) -> float:
    """Best of `ROUNDS` chained graphs of fn(w, w_scale) over the weight sets, us per call."""
    return min(chain_graph_ms(fn, weights) for _ in range(ROUNDS)) * 1e3


def decode_digit(cfg) -> str:
    """The `ROUTES` digit of a decode-kernel config (or its fields where no digit names it)."""
    from deepinfer_kernels.ops import linear

    for digit, fields in linear.DECODE_CONFIGS.items():
        if (cfg.consumers, cfg.min_blocks) == fields:
            return digit
    return f"c{cfg.consumers}mb{cfg.min_blocks}"


def plan_label(plan) -> str:
    """A short name of a `GemmPlan`: `decode D`, `prefill <block_n>/<pieces or p>[ k<split>]`."""
    cfg = plan.config
    if plan.tier == "cuda" and plan.kernel == "decode":
        return f"decode {decode_digit(cfg)}"
    if plan.tier == "cuda" and plan.kernel == "prefill":
        label = f"prefill {cfg.block_n}/{'p' if cfg.persistent else cfg.tail_split}"
        return label + (f" k{cfg.k_split}" if cfg.k_split > 1 else "")
    return f"{plan.tier}.{plan.kernel}"


def shape_rows(rows: list[dict], n: int, k: int, m_list) -> None:
    """One row per M on an [N, K] weight: `ops.fp8_gemm` in both modes (printed as they come)."""
    from deepinfer_kernels import REGISTRY, ops, quant
    from deepinfer_kernels.ops import linear

    weights = weight_sets(n, k)
    for m in m_list:
        x, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda"))
        row = {"shape": f"{n}x{k}", "m": m}
        for mode, inv in (("auto", False), ("inv", True)):
            with REGISTRY.batch_invariant_mode(inv):  # the graphs captured in the mode
                args = (x, xs, *weights[0], torch.bfloat16)
                row[f"{mode} plan"] = plan_label(linear.plans_for("fp8_gemm", m, args, x.device)[0])
                row[mode] = us_per_call(lambda w, s, x=x, xs=xs: ops.fp8_gemm(x, xs, w, s), weights)
        row["tflops"] = 2 * m * n * k / row["auto"] / 1e6
        rows.append(row)
        print(row, flush=True)


def measured_route(times: dict, top: int) -> str:
    """The `ROUTES` entry the bucket's times give (see the module docstring)."""
    digits = {d: t for d, t in times.items() if d.isdigit() and t is not None}
    if not digits:
        return "?"
    best = min(digits, key=digits.get)
    if top <= 64 or times.get("prefill") is None:
        return best
    auto_p = times["prefill"] < digits[best]
    inv_p = times["prefill inv"] is not None and times["prefill inv"] < digits[best]
    if auto_p:
        return "p" if inv_p else f"{best}p"
    return f"{best}?" if inv_p else best


def route_rows(rows: list[dict], n: int, k: int, sms: int, quick: bool) -> None:
    """One row per `ROUTE_M` bucket of an [N, K] weight of `ROUTES` (--quick: above 64 tokens)."""
    from deepinfer_kernels import quant
    from deepinfer_kernels.cuda import decode_gemm as dg
    from deepinfer_kernels.cuda import prefill_gemm as pg
    from deepinfer_kernels.ops import linear

    weights = weight_sets(n, k)
    lo = 1
    for i, top in enumerate(linear.ROUTE_M):
        bucket, lo = (lo, top), top + 1
        if quick and top <= 64:
            continue
        times: dict[str, float | None] = {d: 0.0 for d in linear.DECODE_CONFIGS}
        if top > 64:
            times.update({"prefill": 0.0, "prefill inv": 0.0})
        fill = set()  # the digits the fill rule gives at these M (a `.` entry)
        for m in bucket:
            x, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda"))
            calls = {}
            for digit, fields in linear.DECODE_CONFIGS.items():
                cfg = dg.DecodeGemmCudaConfig(*fields)
                if dg.shape_reason(n, k, m, cfg, sms) is None:
                    calls[digit] = lambda w, s, x=x, xs=xs, c=cfg: dg.decode_gemm(
                        x, xs, w, s, torch.bfloat16, config=c
                    )
            fill.add(decode_digit(dg.fill_config(m, n, k, sms)))
            if top > 64:
                for name, inv in (("prefill", False), ("prefill inv", True)):
                    cfg = pg.call_config(m, n, k, inv, sms)
                    if pg.shape_reason(n, k, cfg) is None:
                        calls[name] = lambda w, s, x=x, xs=xs, c=cfg: pg.fp8_gemm(
                            x, xs, w, s, torch.bfloat16, config=c
                        )
            for name in times:
                if name in calls and times[name] is not None:
                    times[name] += us_per_call(calls[name], weights)
                else:
                    times[name] = None  # the kernel cannot take this config at one of the M
        measured = measured_route(times, top)
        table = linear.ROUTES[n, k].split()[i]
        same = measured == table or (table == "." and measured in fill)
        row = {"shape": f"{n}x{k}", "m": f"{bucket[0]}-{bucket[1]}", **times}
        row.update(measured=measured, routes=table, check="ok" if same else "differs")
        rows.append(row)
        print(row, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"only M in {QUICK_M} (or buckets)")
    parser.add_argument("--routes", action="store_true", help="re-measure ops.linear.ROUTES")
    parser.add_argument(
        "--shapes", nargs="+", metavar="NxK", help="only these weights (a long run in parts)"
    )
    args = parser.parse_args()
    shapes = None
    if args.shapes:
        try:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
        except ValueError:
            parser.error(f"--shapes: NxK, got {args.shapes}")
        if any(len(s) != 2 for s in shapes):
            parser.error(f"--shapes: NxK, got {args.shapes}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill: needs a CUDA GPU")
    from deepinfer_kernels.ops import linear
    from deepinfer_kernels.registry import sm_count

    if args.routes:
        cols = [Col("shape", "shape"), Col("M", "m")]
        cols += [Col(f"decode {d} us", d, ".1f") for d in linear.DECODE_CONFIGS]
        cols += [Col("prefill us", "prefill", ".1f"), Col("prefill inv us", "prefill inv", ".1f")]
        cols += [Col("measured", "measured"), Col("ROUTES", "routes"), Col("check", "check")]
        name = "bench_prefill_routes"
    else:
        cols = [
            Col("shape", "shape"),
            Col("M", "m", "d"),
            Col("auto plan", "auto plan"),
            Col("auto us", "auto", ".1f"),
            Col("TFLOP/s", "tflops", ".0f"),
            Col("inv plan", "inv plan"),
            Col("inv us", "inv", ".1f"),
            Col("inv/auto", lambda r: r["inv"] / r["auto"], ".2f"),
        ]
        name = "bench_prefill"
    table = harness.Table(name, cols)

    def measure(rows: list[dict]) -> None:
        sms = sm_count(torch.device("cuda"))
        table.title = (
            f"{name}: {harness.device_name()}, {sms} SMs, torch {torch.__version__}; us per call "
            f"in one CUDA graph over distinct weights, best of {ROUNDS}"
        )
        if args.routes and sms != linear.H200_SMS:
            table.title += f"; ROUTES holds for {linear.H200_SMS} SMs, not this GPU's"
        if args.routes:
            for n, k in shapes or linear.ROUTES:
                if (n, k) not in linear.ROUTES:
                    raise SystemExit(f"--shapes: {n}x{k} is not a ROUTES weight")
                route_rows(rows, n, k, sms, args.quick)
        else:
            for n, k in shapes or SHAPES:
                shape_rows(rows, n, k, QUICK_M if args.quick else M_LIST)

    harness.run(table, measure)


if __name__ == "__main__":
    main()
