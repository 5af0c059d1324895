"""Benchmark deepinfer_sampling.Sampler against a plain torch sampler, on CPU and CUDA.

Usage: python tools/bench_sampler.py [--vocab 129280] [--rows 1 64 256] [--devices cpu cuda]
       [--configs all top_p] [--flat] [--profile]

Configs (per row, every row seeded):
  all     penalties (presence, frequency, repetition over 64 generated tokens), logit bias,
          min_tokens (half the rows), temperature 0.8, top-k 50, top-p 0.9, min-p 0.05
  top_p   temperature 0.8, top-p 0.9 only (top-p path: the 1024 most likely tokens, a full
          sort only for rows whose kept set reaches past them)
Logits: float32, Zipf-like like a language model's (p ~ rank^-1.2 over a random permutation of
the vocabulary, plus small noise); --flat uses N(0, 3^2) logits instead, whose top-p set is tens
of thousands of tokens wide (worst case for the top-p path: it falls back to sorting).
Baseline: logits / T -> softmax -> sort -> cumsum top-p mask -> torch.multinomial, in the same
process on the same logits. Time per call: `harness.wall_ms`, the mean over repeated calls (the
device synchronised before and after); batch building (SamplingBatch.build) is timed once,
separately. 'no-triton' is Sampler(use_triton=False) (torch.topk + torch ops for the top-k rows)
on CUDA; ratio = ours / baseline. --profile prints the kernels of one call at the largest row
count first. JSON of the rows in $OUT.
"""

from __future__ import annotations

import argparse
import time

import harness
import torch
from deepinfer_sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow
from harness import Col, wall_ms


def baseline_sample(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Plain torch: sort-based top-p + torch.multinomial. logits [R, V] -> token ids [R]."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    sorted_probs = sorted_probs.masked_fill(cumulative - sorted_probs > top_p, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, sorted_ids, sorted_probs)
    return torch.multinomial(probs, 1).squeeze(-1)


def make_rows(config: str, num_rows: int, vocab: int, gen: torch.Generator) -> list[SamplingRow]:
    rows = []
    for i in range(num_rows):
        if config == "all":
            params = SamplingParams(
                temperature=0.8,
                top_k=50,
                top_p=0.9,
                min_p=0.05,
                presence_penalty=0.5,
                frequency_penalty=0.3,
                repetition_penalty=1.1,
                logit_bias={1: 2.0, 7: -3.0},
                min_tokens=100 if i % 2 else 0,
                seed=1000 + i,
                max_tokens=1000,
            )
        else:
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i)
        out = torch.randint(0, vocab, (64,), generator=gen).tolist()
        rows.append(SamplingRow(params, position=500 + i, output_token_ids=out))
    return rows


def make_logits(num_rows: int, vocab: int, flat: bool, gen: torch.Generator) -> torch.Tensor:
    """float32 [num_rows, vocab] benchmark logits."""
    if flat:
        return torch.randn(num_rows, vocab, generator=gen) * 3
    ranks = torch.argsort(torch.rand(num_rows, vocab, generator=gen), dim=1).float() + 1
    return -1.2 * torch.log(ranks) + 0.1 * torch.randn(num_rows, vocab, generator=gen)


def profile_call(fn, device: torch.device) -> None:
    """Print the ops of one call, by self device (or CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=40))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--devices", nargs="+", default=None, help="default: cpu, plus cuda if present")
    ap.add_argument("--configs", nargs="+", default=["all", "top_p"], choices=["all", "top_p"])
    ap.add_argument("--flat", action="store_true", help="N(0, 9) logits instead of Zipf-like")
    ap.add_argument(
        "--profile", action="store_true", help="also print the kernels of one call (largest size)"
    )
    args = ap.parse_args()
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    kind = "N(0,9)" if args.flat else "Zipf-like"
    table = harness.Table(
        "bench_sampler",
        [
            Col("device", "device"),
            Col("config", "config"),
            Col("rows", "rows", "d"),
            Col("ours ms", "ours_ms", ".3f"),
            Col("no-triton ms", "no_triton_ms", ".3f"),
            Col("baseline ms", "baseline_ms", ".3f"),
            Col("ratio", lambda r: r["ours_ms"] / r["baseline_ms"], ".2f"),
            Col("build ms", "build_ms", ".2f"),
        ],
        title=(
            f"bench_sampler: vocab {args.vocab}, float32 {kind} logits, torch {torch.__version__}"
            f", {harness.device_name()}"
        ),
    )
    harness.run(table, lambda rows: measure(rows, args, devices, table))


def measure(rows: list[dict], args, devices: list[str], table: harness.Table) -> None:
    """One row per (device, config, row count), printed as it finishes."""
    sampler = Sampler()
    sampler_torch = Sampler(use_triton=False)  # the same sampler with torch ops only
    gen = torch.Generator().manual_seed(0)
    for dev_name in devices:
        device = torch.device(dev_name)
        for config in args.configs:
            for num_rows in args.rows:
                iters = 50 if device.type == "cuda" else max(2, 64 // num_rows)
                sampling_rows = make_rows(config, num_rows, args.vocab, gen)
                logits = make_logits(num_rows, args.vocab, args.flat, gen).to(device)
                t0 = time.perf_counter()
                batch = SamplingBatch.build(
                    sampling_rows, vocab_size=args.vocab, device=device, eos_token_ids=[0]
                )
                build_ms = (time.perf_counter() - t0) * 1e3
                ours = wall_ms(lambda b=batch, x=logits: sampler(x, b), iters, device)
                plain = None  # the triton kernels run on CUDA only: no second sampler on CPU
                if device.type == "cuda":
                    plain = wall_ms(lambda b=batch, x=logits: sampler_torch(x, b), iters, device)
                base = wall_ms(lambda x=logits: baseline_sample(x, 0.8, 0.9), iters, device)
                row = dict(
                    device=dev_name, config=config, rows=num_rows, ours_ms=ours,
                    no_triton_ms=plain, baseline_ms=base, build_ms=build_ms,
                )  # fmt: skip
                rows.append(row)
                print(f"# {row}", flush=True)
                if args.profile and num_rows == max(args.rows):
                    profile_call(lambda b=batch, x=logits: sampler(x, b), device)
    if any(d.startswith("cuda") for d in devices):
        from deepinfer_sampling import fused

        kernels = ("penalize", "kept_weight", "gumbel_score", "top_p_mask")
        table.title += f"; fused kernels: { {k: getattr(fused, k).status for k in kernels} }"


if __name__ == "__main__":
    main()
