"""Baseline: full-width V4.1 decoder layers on the reference torch path; prints one table.

What runs: the released V4.1-Flash dimensions (`ModelConfig()`: width 5120, 64 heads x 512,
384 FP4 experts top-6 + shared, FP8 32x32 weights), random weights in the checkpoint formats,
every kernel-registry op forced to its `ref` tier (pure torch). Two decoder layers are built:
layer 20, the decoder's source layer (ratio-1 compressor, index keys, indexer with the 2048
candidate blocks), and layer 21, a "reuse" layer (reads layer 20's compressed KV and top-k);
together they are the per-layer cost of the CED decoder (layers 21-39 are like 21, plus the
re-index layers 24/28/32/36). Their times are reported separately.

Rows:
- decode, batch B: one new token for each of B sequences that already hold `--context` tokens
  (the compressed KV / index keys of layer 20 and every window ring are filled with random
  values: no prefill is run to get there). Time per step.
- prefill: one sequence of `--prefill` tokens from an empty cache. Time per prefill.
Peak memory is `torch.cuda.max_memory_allocated()` during the row, and the part of it above
the weights + KV cache allocated before the row (activations and temporaries).

Timing: host wall clock around each layer's call, the device synchronised before and after it;
one warm-up step, then the median of `--iters` steps. Rows print as they finish, the table last.

Usage: python tools/bench_model.py [--device cuda] [--context 8192] [--batches 1,32,256]
       [--prefill 8192] [--iters 3] [--tiny] [--experts N]
       (--tiny: the tiny config; --experts: fewer routed experts; both only to check on CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import harness
import torch
from harness import Col


def ref_tier():
    """A block in which every registry op runs its pure-torch `ref` implementation (the
    baseline)."""
    from deepinfer_kernels import REGISTRY, KernelSettings

    return REGISTRY.configured(
        KernelSettings(
            overrides={op: "ref" for op in REGISTRY.ops()},
            batch_invariant=REGISTRY.settings.batch_invariant,
        )
    )


def fill_random(module: torch.nn.Module, config, seed: int = 0) -> None:
    """Random weights in the checkpoint formats, generated on the module's device.

    FP8 weights: N(0, 16) codes with a power-of-two scale making the weight ~N(0, 1/K);
    FP4 experts: random e2m1 codes (random bytes) with a scale giving ~N(0, 0.5/K);
    plain floats: the tiny checkpoint's rules (norms 1, sinks 0, mHC around a sane base, ...).
    """
    from deepinfer_model.tiny_checkpoint import TensorSpec, init_float_tensor

    gen_dev = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    gen_cpu = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if p.dtype == torch.float8_e8m0fnu:
                continue  # set with its weight
            if p.dtype in (torch.float32, torch.bfloat16):
                spec = TensorSpec(name, tuple(p.shape), p.dtype)
                p.copy_(init_float_tensor(spec, config.hc_mult, gen_cpu))
                continue
            scale = params[name.removesuffix(".weight") + ".scale"]
            if p.dtype == torch.float8_e4m3fn:
                k = p.shape[1] if scale.shape[0] != p.shape[0] else scale.shape[1] * 32
                p.copy_((torch.randn(p.shape, generator=gen_dev, device=p.device) * 16).to(p.dtype))
                _fill_pow2(scale, -4 - round(math.log2(math.sqrt(k))))
            elif p.dtype == torch.int8:
                k = 2 * p.shape[1]
                p.copy_(torch.randint(-128, 128, p.shape, generator=gen_dev, device=p.device))
                _fill_pow2(scale, -2 - round(math.log2(math.sqrt(k))))
            else:
                raise NotImplementedError(f"bench_model: no random init for {name} {p.dtype}")


def _fill_pow2(scale: torch.Tensor, exponent: int) -> None:
    """scale (float8_e8m0fnu) <- 2**exponent, converted from fp32 (exact for a power of two)."""
    scale.copy_(torch.full(scale.shape, 2.0**exponent, device=scale.device).to(scale.dtype))


class Bench:
    def __init__(self, args) -> None:
        from deepinfer_model.cache import CacheSpec, KVCache
        from deepinfer_model.config import ModelConfig
        from deepinfer_model.model import Block

        self.dev = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.config = ModelConfig.tiny() if args.tiny else ModelConfig()
        if args.experts:
            self.config = dataclasses.replace(self.config, n_routed_experts=args.experts)
        c = self.config
        # The decoder's source layer (ratio 1, kv + index + candidate source) and the next one.
        self.src = c.candidate_source_layer_id
        self.layer_ids = [self.src, self.src + 1]
        assert c.compress_ratios[self.src] == 1 and self.src + 1 not in c.index_source_layer_ids
        self.layers = [Block(c, i, self.dtype, self.dev) for i in self.layer_ids]
        for i, layer in zip(self.layer_ids, self.layers, strict=True):
            fill_random(layer, c, seed=i)
        self.weight_bytes = sum(
            p.numel() * p.element_size() for layer in self.layers for p in layer.parameters()
        )
        self.context, self.prefill = args.context, args.prefill
        self.batches = args.batches
        spec = CacheSpec.from_config(c, block_size=64, dtype=self.dtype)
        self.block_size = spec.block_size
        # Pages: the decode rows hold `context` tokens per sequence (+1 for the new token);
        # the prefill row reuses the same pool from page 0.
        per_seq = -(-(self.context + 1) // spec.block_size)
        num_blocks = max(max(self.batches) * per_seq, -(-self.prefill // spec.block_size))
        self.cache = KVCache(c, spec, num_blocks, max(self.batches), self.dev, self.dtype)
        self.per_seq_blocks = per_seq

    def fill_context(self, batch: int) -> None:
        """Random compressed KV / index keys for `context` tokens and random window rings."""
        g = torch.Generator(device=self.dev).manual_seed(1)
        for t in self.cache.compressed_kv.values():
            t.normal_(generator=g)
        for t in self.cache.index_k.values():
            t.normal_(generator=g)
        for ring in self.cache.swa:
            ring[:batch].normal_(generator=g)

    def step(self, batch):
        """Run both layers once on `batch`; return per-layer seconds (synchronised)."""
        from deepinfer_model.layers.mhc import identity_pre
        from deepinfer_model.step_context import StepContext

        c = self.config
        ctx = StepContext.from_batch(batch)
        t = batch.input_ids.shape[0]
        g = torch.Generator(device=self.dev).manual_seed(2)
        h = torch.randn(t, c.hc_mult, c.hidden_size, generator=g, device=self.dev).to(self.dtype)
        pre = identity_pre(t, c.hc_mult, self.dev)
        times = []
        for layer in self.layers:
            self._sync()
            t0 = time.perf_counter()
            h, pre = layer(h, pre, ctx, self.cache)
            self._sync()
            times.append(time.perf_counter() - t0)
        if not torch.isfinite(h).all():
            raise RuntimeError("bench_model: non-finite layer output")
        return times

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def decode_batch(self, b: int):
        from deepinfer_model.batch import ForwardBatch

        n = self.per_seq_blocks
        tables = [list(range(i * n, (i + 1) * n)) for i in range(b)]
        return ForwardBatch.build(
            [[5]] * b, [self.context] * b, list(range(b)), tables, device=self.dev
        )

    def prefill_batch(self):
        from deepinfer_model.batch import ForwardBatch

        n = -(-self.prefill // self.block_size)
        ids = torch.randint(3, self.config.vocab_size, (self.prefill,)).tolist()
        return ForwardBatch.build([ids], [0], [0], [list(range(n))], device=self.dev)

    def measure(self, label: str, make_batch, iters: int, prepare=None) -> dict:
        """Median per-layer time of `iters` steps after one warm-up. Decode steps rewrite the
        same cache position each time, so the context stays `--context` tokens."""
        if prepare is not None:
            prepare()
        batch = make_batch()
        self.step(batch)  # warm-up
        static = self._mem()
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        runs = [self.step(batch) for _ in range(iters)]
        peak = torch.cuda.max_memory_allocated() if self.dev.type == "cuda" else float("nan")
        per_layer = [sorted(r[i] for r in runs)[len(runs) // 2] for i in range(len(self.layers))]
        return {
            "row": label,
            "tokens": int(batch.input_ids.shape[0]),
            "ms": [1e3 * s for s in per_layer],
            "peak_gib": peak / 2**30,
            "act_gib": (peak - static) / 2**30,
        }

    def _mem(self) -> float:
        return torch.cuda.memory_allocated() if self.dev.type == "cuda" else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny config (a CPU check of this tool)")
    ap.add_argument("--experts", type=int, default=0, help="fewer routed experts (CPU check)")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if not args.batches or min(args.batches) < 1:
        ap.error(f"--batches: positive ints, got {args.batches}")
    table = harness.Table("bench_model", [])

    def measure(rows: list[dict]) -> None:
        with ref_tier():
            run(args, table, rows)

    harness.run(table, measure)


def run(args, table: harness.Table, rows: list[dict]) -> None:
    """Build the two layers, then measure each row (printed as it finishes) into `rows`."""
    t0 = time.perf_counter()
    bench = Bench(args)
    setup_s = time.perf_counter() - t0
    c = bench.config
    src, reuse = bench.layer_ids
    table.cols = [
        Col("row", "row"),
        Col("tokens", "tokens", "d"),
        Col(f"layer {src} ms", lambda r: r["ms"][0], ".2f"),
        Col(f"layer {reuse} ms", lambda r: r["ms"][1], ".2f"),
        Col("ms/token (src layer)", lambda r: r["ms"][0] / r["tokens"], ".4f"),
        Col("peak GiB", "peak_gib", ".2f"),
        Col("act+tmp GiB", "act_gib", ".2f"),
    ]
    table.title = (
        f"bench_model: V4.1 decoder layers {bench.layer_ids} ({'tiny' if args.tiny else 'full'} "
        f"dims: D={c.hidden_size}, {c.n_routed_experts} experts top-{c.num_experts_per_tok}), "
        f"ref torch path, {bench.dtype}, {harness.device_name(bench.dev)}; weights "
        f"{bench.weight_bytes / 2**30:.2f} GiB for 2 layers; setup {setup_s:.1f} s"
    )
    print(f"# setup {setup_s:.1f} s", flush=True)
    jobs = [
        (
            f"decode B={b} ctx={args.context}",
            lambda b=b: bench.decode_batch(b),
            args.iters,
            lambda b=b: bench.fill_context(b),
        )
        for b in args.batches
    ]
    if args.prefill:  # before the largest batch, the slowest row on the reference path
        job = (f"prefill 1x{args.prefill}", bench.prefill_batch, max(1, args.iters - 1), None)
        jobs.insert(len(jobs) - 1, job)
    for label, make, iters, prepare in jobs:
        rows.append(bench.measure(label, make, iters, prepare=prepare))
        print(f"# {rows[-1]}", flush=True)


if __name__ == "__main__":
    main()
