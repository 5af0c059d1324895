"""Benchmark several ranks against one: throughput and per-step collective time, or memory per rank.

Usage:
  python tools/bench_parallel.py [--layouts 1,1,1 2,2,1 2,2,2 4,4,2] [--device cpu|cuda]
  python tools/bench_parallel.py --memory [--ep 8] [--extra-experts 0]

Throughput (default): the built-in tiny checkpoint, one `LLM(...)` per layout (D,E,G), each DP
rank given the same work (--prompts-per-dp-rank prompts of --prompt-len tokens, --max-tokens
greedy tokens each, ignore_eos), so a layout's step time against the single-rank engine's is
the per-step cost of the multi-rank path (the step agreement, the MoE dispatch/combine, the
Engram lookups, the idle and padded rows). A warm-up generate first, then one timed generate.
  tok/s          generated tokens / wall time of the timed generate
  step ms        wall time per engine step (mean over ranks)
  coll ms/step   wall time per step in the MoE / Engram / replica collectives; on gloo a
                 collective returns when done, so this is its cost; on NCCL it returns once
                 enqueued (launch cost only), and the step ms difference is the figure
  sync ms/step   the step agreement (one all-reduce of 4 ints on the CPU group)
  load MiB, RSS MiB  checkpoint bytes each rank read (max over ranks) and its peak resident
                 memory after loading (max over ranks)
On an H200 node run it with --device cuda (NCCL; decode through CUDA graphs unless --eager);
it has not been run there yet.

Memory (--memory): the full-width 40-layer V4.1-Flash layout at E = --ep ranks, computed from
the sharding plan (the model built on the meta device with each rank's `RankShard.plan`, no
memory touched): bytes of routed experts, Engram rows, everything replicated, KV per token and
per sequence, and how many KV tokens the rest of an H200 (141 GB x 0.9, after the per-sequence
state of --seqs sequences) holds.
"""

from __future__ import annotations

import argparse
import time

import harness
import torch
from deepinfer_engine.llm import LLM
from deepinfer_sampling.params import SamplingParams
from harness import Col

H200_BYTES = 141e9
GIB = 2**30


def parse_layout(text: str) -> tuple[int, int, int]:
    d, e, g = (int(v) for v in text.split(","))
    return d, e, g


def throughput_rows(args: argparse.Namespace, rows: list[dict]) -> None:
    # the one-rank engine runs in this process: one intra-op thread, as each rank gets on a
    # 2-core box (idle OpenMP threads spinning against other processes cost far more)
    torch.set_num_threads(1)
    for layout in args.layouts:
        d, e, g = layout
        n = args.prompts_per_dp_rank * d
        prompts = [
            {"prompt_token_ids": [(17 * i + 5 * j) % 3000 + 10 for j in range(args.prompt_len)]}
            for i in range(n)
        ]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        kw = dict(
            kv_cache_bytes=64 << 20,
            max_num_seqs=max(8, args.prompts_per_dp_rank),
            accelerator="nvidia" if args.device == "cuda" else "cpu",
        )
        if max(layout) > 1:
            kw |= dict(
                data_parallel_size=d,
                expert_parallel_size=e,
                engram_parallel_size=g,
                expert_dispatch=args.dispatch,
            )
        kw["enforce_eager"] = args.eager
        llm = LLM(**kw)
        try:
            llm.generate(prompts[: max(1, d)], params, use_tqdm=False)  # warm-up
            t0 = time.perf_counter()
            steps0 = llm.engine.stats.steps
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            row = dict(layout=f"{d},{e},{g}", ranks=max(layout), tok_s=tokens / wall)
            if max(layout) == 1:
                steps = llm.engine.stats.steps - steps0
                row |= dict(steps=steps, step_ms=1e3 * wall / steps, coll_ms=0.0, sync_ms=0.0)
            else:
                done = llm.engine.last_run
                steps = done[0].times.steps
                row |= dict(
                    steps=steps,
                    step_ms=1e3 * sum(m.times.steps_s for m in done) / len(done) / steps,
                    coll_ms=1e3 * sum(m.times.comm_s for m in done) / len(done) / steps,
                    sync_ms=1e3 * sum(m.times.sync_s for m in done) / len(done) / steps,
                    load_mib=max(r.loaded_bytes for r in llm.engine.ready) / 2**20,
                    rss_mib=max(r.peak_rss_bytes for r in llm.engine.ready) / 2**20,
                )
            rows.append(row)
        finally:
            llm.shutdown()


def memory_rows(args: argparse.Namespace, rows: list[dict]) -> None:
    from deepinfer_model.cache import CacheSpec
    from deepinfer_model.config import ModelConfig
    from deepinfer_model.model import Model
    from deepinfer_model.rank_shard import RankShard
    from deepinfer_parallel.layout import ParallelLayout

    cfg = ModelConfig()  # V4.1-Flash, full width
    spec = CacheSpec.from_config(cfg, block_size=64, dtype=torch.bfloat16)
    kv_token = spec.bytes_per_block / spec.block_size
    for g in sorted({args.ep, 1}, reverse=True):
        layout = ParallelLayout(args.ep, args.ep, g)
        shard = RankShard.plan(layout, 0, cfg, args.extra_experts)
        model = Model(cfg, dtype=torch.bfloat16, device="meta", shard=shard)
        parts = {"experts": 0, "engram": 0, "dspark": 0, "replicated": 0}
        for name, p in model.named_parameters():
            nbytes = p.numel() * p.element_size()
            if name.startswith("mtp."):
                parts["dspark"] += nbytes
            elif ".ffn.experts." in name:
                parts["experts"] += nbytes
            elif ".engram.embed." in name:
                parts["engram"] += nbytes
            else:
                parts["replicated"] += nbytes
        weights = sum(parts.values())
        budget = H200_BYTES * 0.9 - weights - args.seqs * spec.bytes_per_slot
        rows.append(
            dict(
                layout=f"D={args.ep},E={args.ep},G={g}",
                slots=shard.experts.slots_per_rank if shard.experts else cfg.n_routed_experts,
                experts_gib=parts["experts"] / GIB,
                engram_gib=parts["engram"] / GIB,
                dspark_gib=parts["dspark"] / GIB,
                replicated_gib=parts["replicated"] / GIB,
                weights_gib=weights / GIB,
                kv_token_kib=kv_token / 2**10,
                slot_mib=spec.bytes_per_slot / 2**20,
                kv_tokens=budget / kv_token if budget > 0 else 0.0,
                fits="yes" if budget > 0 else "NO",
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--memory", action="store_true", help="the memory-per-rank table instead")
    ap.add_argument("--layouts", nargs="+", type=parse_layout,
                    default=[(1, 1, 1), (2, 2, 1), (2, 2, 2), (4, 4, 2)])  # fmt: skip
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dispatch", choices=("allgather", "alltoall", "deep_ep"), default=None)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    ap.add_argument("--prompts-per-dp-rank", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ep", type=int, default=8, help="--memory: ranks (D = E = G)")
    ap.add_argument("--extra-experts", type=int, default=0, help="--memory: redundant slots")
    ap.add_argument("--seqs", type=int, default=256, help="--memory: sequences whose per-slot "
                    "state is set aside before the KV tokens are counted")  # fmt: skip
    args = ap.parse_args()
    if args.memory:
        table = harness.Table(
            "bench_parallel_memory",
            [
                Col("layout", "layout"),
                Col("expert slots", "slots", "d"),
                Col("experts GiB", "experts_gib", ".2f"),
                Col("Engram GiB", "engram_gib", ".2f"),
                Col("DSpark GiB", "dspark_gib", ".2f"),
                Col("replicated GiB", "replicated_gib", ".2f"),
                Col("weights GiB", "weights_gib", ".2f"),
                Col("KV KiB/token", "kv_token_kib", ".1f"),
                Col("state MiB/seq", "slot_mib", ".2f"),
                Col(f"KV tokens left ({args.seqs} seqs)", "kv_tokens", ",.0f"),
                Col("fits H200", "fits"),
            ],
            title=f"Memory per rank, V4.1-Flash full width (40 layers, 384 experts, "
            f"+{args.extra_experts} redundant), bf16 activations, from the sharding plan",
        )
        harness.run(table, lambda rows: memory_rows(args, rows))
        return
    table = harness.Table(
        "bench_parallel",
        [
            Col("D,E,G", "layout"),
            Col("ranks", "ranks", "d"),
            Col("tok/s", "tok_s", ".1f"),
            Col("steps", "steps", "d"),
            Col("step ms", "step_ms", ".2f"),
            Col("coll ms/step", "coll_ms", ".2f"),
            Col("sync ms/step", "sync_ms", ".3f"),
            Col("coll % of step", lambda r: 100 * r["coll_ms"] / r["step_ms"], ".0f"),
            Col("load MiB", "load_mib", ".1f"),
            Col("RSS MiB", "rss_mib", ".0f"),
        ],
        title=f"Tiny checkpoint on {args.device} ({harness.device_name(args.device)}), "
        f"{args.prompts_per_dp_rank} prompts x {args.prompt_len} tokens per DP rank, "
        f"{args.max_tokens} greedy tokens each, dispatch {args.dispatch or 'default'}",
    )
    harness.run(table, lambda rows: throughput_rows(args, rows))


if __name__ == "__main__":
    main()
