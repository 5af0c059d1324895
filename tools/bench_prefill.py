"""The dense FP8 prefill GEMM across M on the cuda prefill kernel (`cuda/fp8_gemm.py`): the
registry's `ops.fp8_gemm` in auto mode (the tile width, and the last partial wave's cut or
persistent CTAs, that `call_config` picks) and in batch-invariant mode, beside the kernel on each
tile width with and without the tail cut, and past one wave on persistent CTAs (`/p`), for V4.1's
weight shapes. One CUDA graph of calls over distinct weights (the engine's harness,
`chain_graph_ms`), best of `ROUNDS`; us per call, the auto row's TFLOP/s, and the time
`call_time` models for each config over the uncut 128-column tiles', to check the model's
constants (`N64_TILE_TIME`, `TILE_FIXED_STAGES`, `CUT_FIXED_STAGES`, `CUT_SLOWDOWN`,
`CUT_MAX_WAVES`, `PERSISTENT_SAVED_STAGES` in `cuda/fp8_gemm.py`) against what the GPU measures.

`--routes` instead measures what `cuda.decode_gemm.ROUTES` holds: for each of its weights and
each `ROUTE_M` bucket above 64 tokens (at the bucket's first and last M), the decode kernel (its
`pick_config`) against the prefill kernel's auto and batch-invariant configs, and the route those
times give beside the one in `ROUTES`.

`python tools/bench_prefill.py [--quick | --routes]` on the GPU machine; the table last."""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import replace

import torch
from bench_common import chain_graph_ms, fp8_weights

SHAPES = ((5120, 8192), (4608, 5120), (7168, 2048), (2112, 7168), (32768, 1280))
"""V4.1's dense weights [N, K] that prefill runs on the prefill kernel."""
M_LIST = (256, 384, 512, 640, 768, 1024, 1536, 2048, 4096, 8192)
QUICK_M = (512, 1024, 8192)
ROUNDS = 3
WEIGHT_BYTES = 1 << 30  # distinct weights per graph: more than the L2 holds, at least 4 sets


def weight_sets(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Distinct [N, K] FP8 weights for one graph: `WEIGHT_BYTES` of them, 4 to 16 sets."""
    return fp8_weights(n, k, max(4, min(16, WEIGHT_BYTES // (n * k))))


def shape_rows(n: int, k: int, m_list: tuple[int, ...], sms: int) -> list[dict]:
    """The rows of one weight shape [N, K], one per M (printed as they come)."""
    from deepinfer_kernels import REGISTRY, ops, quant
    from deepinfer_kernels.cuda import fp8_gemm as fg

    weights = weight_sets(n, k)
    rows = []
    for m in m_list:
        x, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda"))

        def us(fn, x=x, xs=xs):
            runs = [chain_graph_ms(lambda w, s: fn(x, xs, w, s), weights) for _ in range(ROUNDS)]
            return min(runs) * 1e3

        auto = fg.call_config(m, n, k, False, sms)
        schedule = "p" if auto.persistent else auto.tail_split
        row = {"shape": f"{n}x{k}", "m": m, "cfg": f"{auto.block_n}/{schedule}"}
        row["auto"] = us(ops.fp8_gemm)
        with REGISTRY.batch_invariant_mode():
            row["inv"] = us(ops.fp8_gemm)  # captured in the mode
        for block_n in (128, 64):
            split = fg.tail_split_for(fg.tiles_of(m, n, block_n), k, sms)
            for cut in sorted({1, split}):
                cfg = fg.config_for(k, replace(fg.DEFAULT, block_n=block_n, tail_split=cut))
                key = f"{block_n}/{cut}"
                row[key] = us(lambda *a, cfg=cfg: fg.fp8_gemm(*a, config=cfg))
                row["model " + key] = fg.call_time(m, n, k, block_n, cut, sms)
            if fg.tiles_of(m, n, block_n) > sms:  # one CTA per SM over the tiles (uncut waves)
                cfg = fg.config_for(k, replace(fg.DEFAULT, block_n=block_n, persistent=True))
                key = f"{block_n}/p"
                row[key] = us(lambda *a, cfg=cfg: fg.fp8_gemm(*a, config=cfg))
                row["model " + key] = fg.call_time(m, n, k, block_n, 1, sms, persistent=True)
        row["tflops"] = 2 * m * n * k / row["auto"] / 1e6
        rows.append(row)
        print(row, flush=True)
    return rows


def route_rows(n: int, k: int, sms: int) -> list[dict]:
    """One row per `ROUTE_M` bucket above 64 tokens of an [N, K] weight of `ROUTES`: us summed
    over the bucket's first and last M on the decode kernel, the prefill kernel's auto config and
    its batch-invariant config; the route they give (- / a / b as in `ROUTES`; ? where only
    batch-invariant mode would take the prefill kernel, which `ROUTES` cannot say) and ROUTES'."""
    from deepinfer_kernels import quant
    from deepinfer_kernels.cuda import decode_gemm as dg
    from deepinfer_kernels.cuda import fp8_gemm as fg

    weights = weight_sets(n, k)
    rows, lo = [], 1
    for i, top in enumerate(dg.ROUTE_M):
        if top <= 64:
            lo = top + 1
            continue
        times = {"decode": 0.0, "auto": 0.0, "inv": 0.0}
        for m in (lo, top):
            x, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda"))
            auto, inv = fg.call_config(m, n, k, False, sms), fg.call_config(m, n, k, True, sms)
            calls = {
                "decode": lambda w, s, x=x, xs=xs: dg.decode_gemm(x, xs, w, s),
                "auto": lambda w, s, x=x, xs=xs, c=auto: fg.fp8_gemm(x, xs, w, s, config=c),
                "inv": lambda w, s, x=x, xs=xs, c=inv: fg.fp8_gemm(x, xs, w, s, config=c),
            }
            for name, fn in calls.items():
                runs = [chain_graph_ms(fn, weights) for _ in range(ROUNDS)]
                times[name] += min(runs) * 1e3
        auto_p, inv_p = times["auto"] < times["decode"], times["inv"] < times["decode"]
        measured = ("b" if inv_p else "a") if auto_p else ("?" if inv_p else "-")
        row = {"shape": f"{n}x{k}", "m": f"{lo}-{top}", **times, "measured": measured}
        row["routes"] = dg.ROUTES[n, k][i]
        rows.append(row)
        print(row, flush=True)
        lo = top + 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only M in {QUICK_M}")
    parser.add_argument("--routes", action="store_true", help="the routes at 65-256 tokens")
    args = parser.parse_args()
    # `timeout` sends SIGTERM: leave through the finally below, so the table still prints
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_prefill: SIGTERM"))
    if not torch.cuda.is_available():
        sys.exit("bench_prefill: needs a CUDA GPU")
    from deepinfer_kernels.cuda import module

    sms = module.sm_count(torch.device("cuda"))
    rows = []
    try:
        if args.routes:
            from deepinfer_kernels.cuda.decode_gemm import ROUTES

            for n, k in ROUTES:
                rows += route_rows(n, k, sms)
        else:
            for n, k in SHAPES:
                rows += shape_rows(n, k, QUICK_M if args.quick else M_LIST, sms)
    finally:  # a run cut off by its time limit still prints what it measured
        (print_routes if args.routes else print_table)(rows)


def print_table(rows: list[dict]) -> None:
    """One line per (shape, M): the registry's two modes, then each config measured as
    us (measured / modelled time over the uncut 128-column config's)."""
    print(f"\n{'shape':>11} {'M':>5} {'auto cfg':>8} {'auto us':>8} {'TF/s':>5} {'inv us':>8}  "
          "configs (block_n/pieces or p: us, measured/modelled ratio to 128/1)")  # fmt: skip
    for r in rows:
        base, model = r["128/1"], r["model 128/1"]
        cells = [
            f"{key} {r[key]:7.1f} {r[key] / base:4.2f}/{r['model ' + key] / model:4.2f}"
            for key in r
            if key.startswith(("128/", "64/"))
        ]
        print(f"{r['shape']:>11} {r['m']:5} {r['cfg']:>8} {r['auto']:8.1f} {r['tflops']:5.0f} "
              f"{r['inv']:8.1f}  " + "  ".join(cells))  # fmt: skip


def print_routes(rows: list[dict]) -> None:
    """One line per (weight, bucket): us over the bucket's first and last M per kernel, the route
    those give and the one `ROUTES` holds (a mismatch marked)."""
    print(f"\n{'shape':>11} {'M':>8} {'decode':>8} {'auto':>8} {'inv':>8}  measured  ROUTES")
    for r in rows:
        mark = "" if r["measured"] == r["routes"] else "  <- differs"
        print(f"{r['shape']:>11} {r['m']:>8} {r['decode']:8.1f} {r['auto']:8.1f} {r['inv']:8.1f}  "
              f"{r['measured']:>8}  {r['routes']:>6}{mark}")  # fmt: skip


if __name__ == "__main__":
    main()
