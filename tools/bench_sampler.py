"""Benchmark deepinfer_sampling.Sampler against a plain torch sampler, on CPU and CUDA.

Usage: python tools/bench_sampler.py [--vocab 129280] [--rows 1 64 256] [--devices cpu cuda]

Configs (per row, every row seeded):
  all     penalties (presence, frequency, repetition over 64 generated tokens), logit bias,
          min_tokens (half the rows), temperature 0.8, top-k 50, top-p 0.9, min-p 0.05
  top_p   temperature 0.8, top-p 0.9 only (top-p path: the 1024 most likely tokens, a full
          sort only for rows whose kept set reaches past them)
Logits: float32, Zipf-like like a language model's (p ~ rank^-1.2 over a random permutation of
the vocabulary, plus small noise); --flat uses N(0, 3^2) logits instead, whose top-p set is tens
of thousands of tokens wide (worst case for the top-p path: it falls back to sorting).
Baseline: logits / T -> softmax -> sort -> cumsum top-p mask -> torch.multinomial, in the same
process on the same logits. Time per call is the mean over repeated calls (device synchronised
before and after); batch building (SamplingBatch.build) is timed separately. 'no-triton' is
Sampler(use_triton=False) (torch.topk + torch ops for the top-k rows) on CUDA; ratio = ours /
baseline. --chunks (and --groups) also time the triton top-k draw alone at those stage-1 chunk
(and group) widths, at every --rows.

Last measured (H200, torch 2.11, triton 3.6, vocab 129280, Zipf-like; exact top-k by group
maxima, `--devices cuda --chunks 2048`):
    config  rows  ours ms  no-triton  baseline ms  ratio
    all        1    0.144      0.321        0.295   0.49
    all       64    0.190      0.374        1.285   0.15
    all      256    0.225      0.637        4.063   0.06
    top_p      1    0.546      0.535        0.359   1.52
    top_p     64    0.603      0.602        1.285   0.47
    top_p    256    1.431      1.430        4.062   0.35
    topk_draw alone, chunk 2048 (default), rows 1 / 64 / 256: 0.082 / 0.086 / 0.134 ms
Stage-1 knobs, an earlier run of the same code (noisier host), topk_draw alone at 1 / 64 / 256
rows: chunk 2048 group 32: 0.121 / 0.076 / 0.134; chunk 2048 group 64: 0.083 / 0.102 / 0.139;
chunk 4096 group 32: 0.103 / 0.090 / 0.194; chunk 4096 group 64: 0.099 / 0.112 / 0.138 ms.
"""

from __future__ import annotations

import argparse
import time

import torch
from deepinfer_sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow


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


def timeit(fn, device: torch.device, iters: int) -> float:
    """Mean seconds per call of fn()."""
    fn()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


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


def time_knobs(chunk: int, group: int | None, rows: list[int], vocab: int, gen) -> str:
    """One table line: the triton top-k draw alone (config 'all') at each row count, for one
    (stage-1 chunk width, group width); group None = the default for top-k 50."""
    from deepinfer_sampling.topk_triton import topk_draw

    device = torch.device("cuda")
    cells = []
    for num_rows in rows:
        x = make_logits(num_rows, vocab, False, gen).to(device)
        rows_all = make_rows("all", num_rows, vocab, gen)
        g = SamplingBatch.build(rows_all, vocab_size=vocab, device=device).topk
        args = (x, g.rng_keys, g.temperature, g.top_k, g.top_p, g.log_min_p)
        kw = dict(max_top_k=g.max_top_k, use_min_p=g.use_min_p, use_top_p=g.use_top_p)
        kw.update(chunk=chunk, group=group)
        ms = timeit(lambda a=args, k=kw: topk_draw(*a, **k), device, 50) * 1e3
        cells.append(f"{ms:8.3f}")
    return f"topk_draw alone  chunk {chunk:5d} group {group or 'dflt':>4}: " + " ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--devices", nargs="+", default=None, help="default: cpu, plus cuda if present")
    ap.add_argument("--configs", nargs="+", default=["all", "top_p"])
    ap.add_argument("--flat", action="store_true", help="N(0, 9) logits instead of Zipf-like")
    ap.add_argument(
        "--chunks",
        type=int,
        nargs="*",
        default=[],
        help="also time the triton top-k draw alone at these stage-1 chunk widths (CUDA)",
    )
    ap.add_argument(
        "--groups",
        type=int,
        nargs="*",
        default=[0],
        help="... and these group widths (0 = default; each with every --chunks width)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="also print the kernels of one call (largest size)"
    )
    args = ap.parse_args()
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sampler = Sampler()
    sampler_torch = Sampler(use_triton=False)  # the same sampler with torch ops only
    gen = torch.Generator().manual_seed(0)
    header = (
        f"{'device':6} {'config':6} {'rows':>5} {'ours ms':>9} {'no-triton':>9} "
        f"{'baseline ms':>11} {'ratio':>6} {'build ms':>9}"
    )
    lines = [header, "-" * len(header)]
    for dev_name in devices:
        device = torch.device(dev_name)
        for config in args.configs:
            for num_rows in args.rows:
                iters = 50 if device.type == "cuda" else max(2, 64 // num_rows)
                rows = make_rows(config, num_rows, args.vocab, gen)
                logits = make_logits(num_rows, args.vocab, args.flat, gen).to(device)
                t0 = time.perf_counter()
                batch = SamplingBatch.build(
                    rows, vocab_size=args.vocab, device=device, eos_token_ids=[0]
                )
                build_ms = (time.perf_counter() - t0) * 1e3
                ours = timeit(lambda b=batch, x=logits: sampler(x, b), device, iters)
                if device.type == "cuda":
                    plain = timeit(lambda b=batch, x=logits: sampler_torch(x, b), device, iters)
                    plain_ms = f"{plain * 1e3:9.3f}"
                else:
                    plain_ms = f"{'=':>9}"  # the triton kernels run on CUDA only
                base = timeit(lambda x=logits: baseline_sample(x, 0.8, 0.9), device, iters)
                lines.append(
                    f"{dev_name:6} {config:6} {num_rows:5d} {ours * 1e3:9.3f} {plain_ms} "
                    f"{base * 1e3:11.3f} {ours / base:6.2f} {build_ms:9.2f}"
                )
                print(lines[-1], flush=True)
                if args.profile and num_rows == max(args.rows):
                    profile_call(lambda b=batch, x=logits: sampler(x, b), device)
    if args.chunks:
        lines.append(f"{'ms per call at rows':42} " + " ".join(f"{r:8d}" for r in args.rows))
    for chunk in args.chunks:
        for group in args.groups:
            lines.append(time_knobs(chunk, group or None, args.rows, args.vocab, gen))
            print(lines[-1], flush=True)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    kind = "N(0,9)" if args.flat else "Zipf-like"
    print(f"\nvocab {args.vocab}, float32 {kind} logits, torch {torch.__version__}, {name}")
    print("\n".join(lines))
    if any(d.startswith("cuda") for d in devices):
        from deepinfer_sampling import fused

        kernels = ("penalize", "kept_weight", "gumbel_score", "top_p_mask")
        print("fused kernels:", {k: getattr(fused, k).status for k in kernels})


if __name__ == "__main__":
    main()
