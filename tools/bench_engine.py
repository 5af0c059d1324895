"""Benchmark the offline engine: throughput, host time per step, GPU idleness per decode step.

Usage: python tools/bench_engine.py [--models tiny slice stub] [--batches 1 64 256] [--device cuda]

Models:
  tiny   the built-in tiny V4.1 checkpoint (loaded through the loader).
  slice  a full-width V4.1-Flash slice: real hidden/attention/indexer/MoE widths, all 384
         routed experts on CUDA (29 GB; 16 on CPU; --slice-experts to change), 4 layers
         (ratios 0,0,2,1: every attention kind), random weights in the checkpoint formats (the
         experts as random FP4 codes drawn on the device, `init_random_(expert_codes=True)`, so
         it builds in seconds); no Engram tables (94 GiB each). Prompts and outputs are token
         ids (a synthetic detokenizer).
  stub   no model: the forward returns zero logits [rows, 129280] on the device at once, so the
         table shows the engine's own host cost per step (scheduling, batch building, sampling,
         detokenisation); its KV cache has the tiny model's layout.
For each model and batch size B, B prompts of --prompt-len tokens generate tokens (ignore_eos),
with async scheduling on and off in the same process (the order alternates between batch
sizes). Each run: prefill, --warm decode steps (not measured), --steps timed decode steps, one
decode step under CUDA sync-debug mode, then --prof-steps decode steps under torch.profiler
(CUDA activity only). Reported:
  tok/s         generated tokens / wall time of the timed steps
  host ms/step  wall time of engine.step() minus the time it waits for the device (resolve)
  step ms       wall time per timed step
  GPU busy ms   per profiled step: the union of the GPU's kernel/memcpy/memset intervals
  GPU idle %    1 - busy / span, span = first kernel start .. last kernel end of the profiled
                steps (the whole GPU timeline of those steps, gaps inside the forward included)
  mode          graph: pure decode steps replay piecewise CUDA graphs (the default on CUDA);
                eager: the same engine with its graphs switched off (enforce_eager)
  syncs         device->host synchronisations the sync-debug step saw in launch (forward) and
                sample (the engine's resolve wait is the one intended and not counted)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import tempfile
import time
import warnings
from contextlib import contextmanager

import harness
import torch
from deepinfer_engine.llm import LLM
from deepinfer_model.runtime import ModelRuntime
from deepinfer_sampling.params import SamplingParams
from harness import Col


class IdTokenizer:
    """Synthetic detokenizer for the random slice: token i -> " t{i}"."""

    def encode(self, text: str) -> list[int]:
        return [int(t[1:]) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" t{i}" for i in ids)


def slice_bundle(device: str, experts: int) -> ModelRuntime:
    from deepinfer_model.config import ModelConfig
    from deepinfer_model.model import Model, init_random_

    cfg = ModelConfig(
        num_hidden_layers=4,
        compress_ratios=(0, 0, 2, 1),
        kv_source_layer_ids=(2, 3),
        index_source_layer_ids=(2, 3),
        candidate_source_layer_id=3,
        engram_layer_ids=(),
        engram_num_embeddings=(),
        num_nextn_predict_layers=0,
        dspark_target_layer_ids=(1, 2, 3),
        n_routed_experts=experts,
        max_position_embeddings=8192,
    )
    cfg.validate()
    with torch.device(device):
        model = Model(cfg, dtype=torch.bfloat16)
    init_random_(model, seed=0, expert_codes=True)
    model.eval()
    return ModelRuntime(model, cfg, IdTokenizer(), "v41-slice")


class ZeroLogits(torch.nn.Module):
    """A stand-in model whose forward returns zero logits [rows, vocab] fp32 on its device."""

    def __init__(self, vocab: int, device: str) -> None:
        super().__init__()
        self.vocab, self.device = vocab, torch.device(device)

    def forward(self, batch, cache):
        from deepinfer_model.batch import ForwardOutput

        rows = batch.logits_indices.shape[0]
        return ForwardOutput(torch.zeros(rows, self.vocab, device=self.device))


class StubRuntime(ModelRuntime):
    """The tiny config's cache with `ZeroLogits` as the forward, and no CUDA graphs."""

    def decode_graphs(self, max_batch: int) -> None:
        return None


def stub_bundle(device: str) -> ModelRuntime:
    import dataclasses

    from deepinfer_model.config import ModelConfig

    vocab = 129280  # V4.1's, so the sampler works at its real width
    cfg = dataclasses.replace(ModelConfig.tiny(), vocab_size=vocab)
    return StubRuntime(ZeroLogits(vocab, device), cfg, IdTokenizer(), "stub")


class Probe:
    """Wraps one engine's runner to time the host's waits and, on request, catch syncs."""

    def __init__(self, llm: LLM) -> None:
        self.eng = llm.engine
        self.cuda = self.eng.device.type == "cuda"
        self.wait_s = 0.0
        self.check_sync = False
        self.syncs: list[str] = []
        runner = self.eng.runner
        launch, sample, resolve = runner.launch, runner.sample, runner.resolve

        def launch_w(out, prev):
            with self._sync_debug("launch"):
                return launch(out, prev)

        def sample_w(step, eos):
            with self._sync_debug("sample"):
                return sample(step, eos)

        def resolve_w(sampled, step):
            t = time.perf_counter()
            if sampled is not None and sampled.event is not None:
                sampled.event.synchronize()
            self.wait_s += time.perf_counter() - t
            return resolve(sampled, step)

        runner.launch, runner.sample, runner.resolve = launch_w, sample_w, resolve_w

    @contextmanager
    def _sync_debug(self, where: str):
        if not (self.cuda and self.check_sync):
            yield
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                self.syncs.append(f"{where}: {os.path.basename(w.filename)}:{w.lineno}")


def gpu_busy(trace_path: str) -> tuple[float, float]:
    """(busy ms, span ms) of a chrome trace: union of GPU kernel/memcpy/memset intervals, and
    first start .. last end."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    iv = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not iv:
        return 0.0, 0.0
    busy, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / 1e3, (max(e for _, e in iv) - iv[0][0]) / 1e3


def run_one(llm: LLM, probe: Probe, batch: int, args, async_on: bool, graphs) -> dict:
    """One measured run; `graphs` is the runner's DecodeGraphs to use, or None (eager)."""
    eng = llm.engine
    eng.config.async_scheduling = async_on
    eng.runner.graphs = graphs
    g = torch.Generator().manual_seed(batch)
    vocab = min(eng.model.vocab_size, 500)
    prompts = [
        torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)
    ]
    new = args.warm + args.steps + 1 + args.prof_steps + 4
    sp = SamplingParams(
        temperature=0.8, top_p=0.95, top_k=args.top_k, seed=1, max_tokens=new, ignore_eos=True
    )
    reqs = [eng.add_request(r) for r in _validated(llm, prompts, sp)]
    seqs = [s for r in reqs for s in r.seqs]

    def decoding() -> bool:
        return all(s.num_computed_tokens >= s.num_prompt_tokens for s in seqs)

    while eng.has_unfinished() and not decoding():
        eng.step()
    for _ in range(args.warm):
        eng.step()
    step_s, host_s = [], []
    prof = cProfile.Profile() if args.cprofile else None
    tok0, t_start = eng.stats.tokens_generated, time.perf_counter()
    for _ in range(args.steps):
        w0, t0 = probe.wait_s, time.perf_counter()
        if prof is not None:
            prof.enable()
        eng.step()
        if prof is not None:
            prof.disable()
        dt = time.perf_counter() - t0
        step_s.append(dt)
        host_s.append(dt - (probe.wait_s - w0))
    wall = time.perf_counter() - t_start
    if prof is not None:
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.cprofile)
            lines = out.getvalue().splitlines()
            head = next(i for i, line in enumerate(lines) if "ncalls" in line)
            print(f"# host profile, {args.steps} timed steps, by {key}:", flush=True)
            print("\n".join(lines[head : head + 1 + args.cprofile]), flush=True)
    tokens = eng.stats.tokens_generated - tok0
    probe.check_sync, probe.syncs = True, []
    eng.step()
    probe.check_sync = False
    busy = span = float("nan")
    if probe.cuda:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.prof_steps):
                eng.step()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        prof.export_chrome_trace(path)
        busy, span = gpu_busy(path)
        os.unlink(path)
    while eng.has_unfinished():
        eng.step()
    if probe.cuda:
        torch.cuda.synchronize()
    return {
        "tok/s": tokens / wall if wall > 0 else float("nan"),
        "host ms/step": 1e3 * statistics.median(host_s),
        "step ms": 1e3 * statistics.median(step_s),
        "GPU busy ms": busy / args.prof_steps,
        "GPU idle %": 100 * (1 - busy / span) if span and span == span else float("nan"),
        "syncs": len(probe.syncs),
        "sync sites": sorted(set(probe.syncs)),
    }


def _validated(llm: LLM, prompts, sp):
    from deepinfer_engine.validation import validate_requests

    eng = llm.engine
    return validate_requests(
        prompts, sp, eng.tokenizer.encode, eng.model.vocab_size, eng.max_model_len
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--models", nargs="+", default=["tiny", "slice"], choices=["tiny", "slice", "stub"]
    )
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--warm", type=int, default=3, help="decode steps before measuring")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps")
    ap.add_argument("--prof-steps", type=int, default=6, help="profiled decode steps")
    ap.add_argument(
        "--slice-experts", type=int, default=None, help="default: 384 on CUDA, 16 on CPU (RAM)"
    )
    ap.add_argument(
        "--top-k", type=int, default=0, help="top-k with the top-p 0.95 (0 = top-p alone)"
    )
    ap.add_argument(
        "--cprofile", type=int, default=0, help="print the N top host functions of timed steps"
    )
    args = ap.parse_args()
    if args.slice_experts is None:
        args.slice_experts = 384 if args.device == "cuda" else 16
    table = harness.Table(
        "bench_engine",
        [
            Col("model", "model"),
            Col("batch", "batch", "d"),
            Col("async", "async"),
            Col("mode", "mode"),
            Col("tok/s", "tok/s", ".1f"),
            Col("host ms/step", "host ms/step", ".2f"),
            Col("step ms", "step ms", ".2f"),
            Col("GPU busy ms", "GPU busy ms", ".2f"),
            Col("GPU idle %", "GPU idle %", ".1f"),
            Col("syncs", "syncs", "d"),
        ],
        title=(
            f"bench_engine on {harness.device_name(args.device)}: prompt {args.prompt_len} "
            f"tokens, decode steps: {args.warm} warm, {args.steps} timed, {args.prof_steps} "
            f"profiled; temperature 0.8 top-p 0.95 top-k {args.top_k or 'off'} seeded"
        ),
    )
    harness.run(table, lambda rows: _measure(args, rows))


def _measure(args, rows: list) -> None:
    """Build each model and append one row per (batch, async, mode) run to `rows`."""
    accel = "nvidia" if args.device == "cuda" else "cpu"
    for name in args.models:
        t = time.perf_counter()
        if name == "tiny":
            llm = LLM(
                None, accelerator=accel, max_num_seqs=max(args.batches), gpu_memory_utilization=0.5
            )
        else:
            build = slice_bundle if name == "slice" else lambda dev, _: stub_bundle(dev)
            llm = LLM.from_model(
                build(args.device, args.slice_experts),
                accelerator=accel,
                max_num_seqs=max(args.batches),
                max_model_len=4096,
                gpu_memory_utilization=0.5,
            )
        print(f"# {name}: built in {time.perf_counter() - t:.1f}s on {args.device}", flush=True)
        probe = Probe(llm)
        # Warm-up (lazy CUDA init, kernel compilation, pinned buffers), not reported.
        warm = argparse.Namespace(
            **{**vars(args), "warm": 1, "steps": 1, "prof_steps": 1, "cprofile": 0}
        )
        graphs = llm.engine.runner.graphs
        # (async, graphs) per batch size; the order alternates between batch sizes
        modes = [(True, graphs), (False, graphs)] + ([(True, None)] if graphs else [])
        for b in args.batches:
            for a, g in modes:
                run_one(llm, probe, b, warm, a, g)  # also captures the bucket's graphs
        for i, b in enumerate(args.batches):
            for async_on, g in modes if i % 2 == 0 else modes[::-1]:
                # profile the host in the first mode only (cProfile slows every call)
                first = (async_on, g) == modes[0]
                run_args = args if first else argparse.Namespace(**{**vars(args), "cprofile": 0})
                r = run_one(llm, probe, b, run_args, async_on, g)
                a, mode = "on" if async_on else "off", "graph" if g else "eager"
                rows.append({"model": name, "batch": b, "async": a, "mode": mode, **r})
                print(f"#   {name} B={b} async={a} {mode}: {r}", flush=True)
        del llm, probe  # give the KV cache and weights back before the next model
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
