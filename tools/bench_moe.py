"""Re-measure the MoE routing thresholds of `ops/moe.py` on this GPU; print one table.

`ops.moe.cuda_config` and `ops.moe.triton_config` pick the routed experts' kernels by the pairs
routed per expert (T tokens x 6 / 384 experts in V4.1) and the mode; their thresholds are
`PREFILL_PAIRS_PER_EXPERT` (the Triton tier's 16- to 64-row tiles, and batch-invariant mode's
cuda decode to prefill kernels), `CUDA_PREFILL_PAIRS_PER_EXPERT` (auto mode's cuda decode to
prefill kernels), `CUDA_TILE8_TOKENS` (the decode kernels' 8- to 16-token routing tiles) and
`wide_tiles_pay` (the prefill kernels' 128- to 160-token tiles). For each mode, at token counts
either side of them, this times every kernel config the table chooses between for that mode
(the tier kernels called with that config: `ops.moe.cuda_moe_experts` /
`ops.moe.triton_moe_experts`), on one V4.1 MoE layer of random FP4 experts:
- cuda auto: mma.sync fed by the TMA on 8- / 16-token tiles (`TMA`, `TMA_TILE16`), the wgmma
  prefill kernels on 128- / 160-token tiles (`WGMMA_PREFILL`, `wide_tiles` of it);
- cuda inv: the wgmma decode kernels (`WGMMA_DEFAULT`), the prefill ones on the byte exchange
  (`WGMMA_PREFILL_EXCHANGE`, 128 / 160);
- cuda inv frag: the same on fragment-order weights (`WGMMA_FRAGMENT`,
  `WGMMA_PREFILL_FRAGMENT`, 128 / 160), as the model keeps them in batch-invariant mode;
- triton auto / inv (not with --quick): `DECODE` or `DECODE_WGMMA` against `PREFILL`.
`table` marks the config the table picks at that T; `/best` is a row's time over the fastest of
its mode at that T (1.00 on the picked row: the table holds there).

Timing: up to 256 tokens one CUDA graph of 8 calls on 8 routings, ms per call
(`harness.chain_graph_ms`: decode sizes, which the engine replays as graphs); above, eager
(`harness.bench_ms`) on one routing (prefill sizes, which the engine runs eagerly).

`python tools/bench_moe.py [--quick] [--tokens T ...]` on the GPU machine. JSON of the rows in
$OUT.
"""

from __future__ import annotations

import argparse

import harness
import torch
from harness import Col, Rotating, bench_ms, chain_graph_ms

TOKENS = (64, 256, 384, 512, 640, 1024, 1280, 2048, 4096, 6144, 8192, 16384)
"""Either side of each threshold for V4.1's 384 experts, top-6 (pairs per expert = T / 64):
8-token tiles up to 256, prefill kernels above 512 (batch-invariant mode, Triton) and 1024
(auto), 160-token tiles where they take fewer passes (8192, 16384; not 6144)."""
QUICK_TOKENS = (256, 384, 512, 640, 1024, 1280, 8192)
GRAPH_MAX_T = 256
"""Up to this many tokens the rows are chained CUDA graphs, above eager."""


def candidates(tier: str, inv: bool, frag: bool) -> dict:
    """name -> config of every kernel config the routing table chooses between in one mode."""
    if tier == "cuda":
        from deepinfer_kernels.cuda import moe as cm

        if not inv:
            return {
                "mma TMA t8": cm.TMA,
                "mma TMA t16": cm.TMA_TILE16,
                "wgmma prefill t128": cm.WGMMA_PREFILL,
                "wgmma prefill t160": cm.wide_tiles(cm.WGMMA_PREFILL),
            }
        decode = cm.WGMMA_FRAGMENT if frag else cm.WGMMA_DEFAULT
        prefill = cm.WGMMA_PREFILL_FRAGMENT if frag else cm.WGMMA_PREFILL_EXCHANGE
        return {
            "wgmma decode": decode,
            "wgmma prefill t128": prefill,
            "wgmma prefill t160": cm.wide_tiles(prefill),
        }
    from deepinfer_kernels.triton import moe as tm  # (MODES runs it on the checkpoint's order)

    if inv:
        return {"DECODE_WGMMA": tm.DECODE_WGMMA, "PREFILL": tm.PREFILL}
    return {"DECODE": tm.DECODE, "PREFILL": tm.PREFILL}


def picked(tier: str, inv: bool, frag: bool, t: int):
    """The config the routing table gives a call of t tokens in this mode."""
    from deepinfer_kernels.ops import moe

    pairs = t * harness.MOE_K
    if tier == "cuda":
        return moe.cuda_config(inv, frag, t, pairs, harness.MOE_E)
    return moe.triton_config(pairs, harness.MOE_E, inv, frag)


MODES = (  # (tier, mode name, batch-invariant, fragment order)
    ("cuda", "auto", False, False),
    ("cuda", "inv", True, False),
    ("cuda", "inv frag", True, True),
    ("triton", "auto", False, False),
    ("triton", "inv", True, False),
)


def mode_rows(rows: list[dict], tier: str, mode: str, inv: bool, frag: bool, tokens, layer):
    """The rows of one mode: every candidate at every T, then each T's `/best`."""
    from deepinfer_kernels.ops import moe

    g, experts, experts_frag = layer
    ws = experts_frag if frag else experts
    run = moe.cuda_moe_experts if tier == "cuda" else moe.triton_moe_experts
    flops_per_token = 6.0 * harness.MOE_K * harness.MOE_D * harness.MOE_I
    for t in tokens:
        sets = harness.moe_routings(t, 8 if t <= GRAPH_MAX_T else 1, g)
        pick = picked(tier, inv, frag, t)
        group = []
        for name, cfg in candidates(tier, inv, frag).items():

            def fn(x, tw, ids, cfg=cfg):
                return run(
                    x, tw, ids, *ws, harness.MOE_LIMIT, config=cfg, batch_invariant=inv,
                    fragment_order=frag,
                )  # fmt: skip

            if t <= GRAPH_MAX_T:
                ms, timing = chain_graph_ms(fn, sets), f"chain{len(sets)}"
            else:
                ms, timing = bench_ms(Rotating(fn, sets)), "eager"
            row = dict(
                tier=tier, mode=mode, t=t, per_expert=t * harness.MOE_K / harness.MOE_E,
                kernel=name, timing=timing, ms=ms, tflops=flops_per_token * t / ms / 1e9,
                table="pick" if cfg == pick else "",
            )  # fmt: skip
            group.append(row)
            print(row, flush=True)
        best = min(r["ms"] for r in group)
        for r in group:
            r["vs_best"] = r["ms"] / best
        rows += group


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS}, cuda tier only")
    ap.add_argument("--tokens", nargs="+", type=int, help=f"token counts (default {TOKENS})")
    args = ap.parse_args()
    if args.tokens and min(args.tokens) < 1:
        ap.error("--tokens: positive counts")
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe: needs a CUDA GPU")
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    modes = [m for m in MODES if m[0] == "cuda"] if args.quick else MODES
    table = harness.Table(
        "bench_moe",
        [
            Col("tier", "tier"),
            Col("mode", "mode"),
            Col("T", "t", "d"),
            Col("pairs/expert", "per_expert", ".1f"),
            Col("kernel", "kernel"),
            Col("timing", "timing"),
            Col("ms", "ms", ".4f"),
            Col("TFLOP/s", "tflops", ".1f"),
            Col("/best", "vs_best", ".2f"),
            Col("table", "table"),
        ],
    )

    def measure(rows: list[dict]) -> None:
        table.title = (
            f"bench_moe: {harness.device_name()}, torch {torch.__version__}; one MoE layer "
            f"(E={harness.MOE_E}, top-{harness.MOE_K}, D={harness.MOE_D}, I={harness.MOE_I}); "
            f"chained graphs of 8 routings up to T={GRAPH_MAX_T}, eager above"
        )
        g = torch.Generator(device="cuda").manual_seed(0)
        experts, _ = harness.moe_layer(g)
        frag = harness.fragment_experts(experts) if any(m[3] for m in modes) else None
        for tier, mode, inv, on_frag in modes:
            mode_rows(rows, tier, mode, inv, on_frag, tokens, (g, experts, frag))

    harness.run(table, measure)


if __name__ == "__main__":
    main()
