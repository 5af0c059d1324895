"""Benchmark the offline engine: throughput, host time per step, GPU idle between steps.

Usage: python tools/bench_engine.py [--models tiny slice] [--batches 1 64 256] [--device cuda]

Models:
  tiny   the built-in tiny V4.1 checkpoint (loaded through the loader).
  slice  a full-width V4.1-Flash slice: real hidden/attention/indexer/MoE widths, 4 layers
         (ratios 0,0,2,1: every attention kind), random weights in the checkpoint formats;
         fewer routed experts (--slice-experts, default 16) and no Engram tables (94 GiB each) so
         it builds in seconds. Prompts and outputs are token ids (a synthetic detokenizer).
For each model and batch size B, B prompts of --prompt-len tokens generate --max-tokens tokens
each (ignore_eos), with async scheduling on and then off, in the same process. Reported:
  tok/s        generated tokens / wall time of the decode phase (steps after all prefills)
  host ms/step wall time of engine.step() minus the time it waits for the device (resolve)
  step ms      wall time per decode step
  GPU idle %   per decode step, the gap on the GPU timeline between the end of one step's work
               (after sampling) and the start of the next step's forward, over the step period
               (CUDA events; 0 on CPU).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time

import torch
from deepinfer_engine.llm import LLM
from deepinfer_engine.model_runner import ModelBundle
from deepinfer_sampling.params import SamplingParams


class IdTokenizer:
    """Synthetic detokenizer for the random slice: token i -> " t{i}"."""

    def encode(self, text: str) -> list[int]:
        return [int(t[1:]) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" t{i}" for i in ids)


def slice_bundle(device: str, experts: int) -> ModelBundle:
    from deepinfer_model.cache import CacheSpec, KVCache
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
    init_random_(model, seed=0)
    model.eval()
    return ModelBundle(
        model=model,
        tokenizer=IdTokenizer(),
        vocab_size=cfg.vocab_size,
        eos_token_id=cfg.eos_token_id,
        max_position_embeddings=cfg.max_position_embeddings,
        sliding_window=cfg.sliding_window,
        cache_spec=lambda bs, dt: CacheSpec.from_config(cfg, block_size=bs, dtype=dt),
        make_cache=lambda spec, nb, ns, dev, dt: KVCache(cfg, spec, nb, ns, device=dev, dtype=dt),
        name="v41-slice",
    )


class Probe:
    """Wraps one engine's runner and step to time host work and GPU gaps per step."""

    def __init__(self, llm: LLM) -> None:
        self.eng = llm.engine
        self.cuda = self.eng.device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.wait_s = 0.0
        runner = self.eng.runner
        launch, sample, resolve = runner.launch, runner.sample, runner.resolve

        def launch_w(out, prev):
            start = self._event()
            step = launch(out, prev)
            step._probe_start = start
            return step

        def sample_w(step, eos):
            res = sample(step, eos)
            end = self._event()
            if self.cuda:
                self.events.append((step._probe_start, end))
            return res

        def resolve_w(sampled, step):
            t = time.perf_counter()
            if sampled is not None and sampled.event is not None:
                sampled.event.synchronize()
            self.wait_s += time.perf_counter() - t
            return resolve(sampled, step)

        runner.launch, runner.sample, runner.resolve = launch_w, sample_w, resolve_w

    def _event(self):
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e


def run_one(
    llm: LLM, probe: Probe, batch: int, prompt_len: int, max_tokens: int, async_on: bool
) -> dict:
    eng = llm.engine
    eng.config.async_scheduling = async_on
    probe.events.clear()
    g = torch.Generator().manual_seed(batch)
    vocab = min(eng.bundle.vocab_size, 500)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=max_tokens, ignore_eos=True)
    reqs = [eng.add_request(r) for r in _validated(llm, prompts, sp)]
    step_s, host_s, decode_tokens = [], [], 0
    t_decode = None
    while eng.has_unfinished():
        w0, t0 = probe.wait_s, time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        all_prefilled = all(
            s.num_computed_tokens >= s.num_prompt_tokens for r in reqs for s in r.seqs
        )
        if all_prefilled:
            if t_decode is None:
                t_decode, tok0 = time.perf_counter(), eng.stats.tokens_generated
            step_s.append(dt)
            host_s.append(dt - (probe.wait_s - w0))
    if probe.cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - (t_decode or time.perf_counter())
    decode_tokens = eng.stats.tokens_generated - (tok0 if t_decode else 0)
    idle = []
    ev = probe.events[-len(step_s) :] if step_s else []
    for (s0, e0), (s1, _) in itertools.pairwise(ev):
        gap = e0.elapsed_time(s1)
        busy = s0.elapsed_time(e0)
        idle.append(max(gap, 0.0) / max(gap + busy, 1e-9))
    steady = step_s[2:] or step_s
    return {
        "tok/s": decode_tokens / wall if wall > 0 else float("nan"),
        "host ms/step": 1e3 * statistics.median(host_s[2:] or host_s or [0.0]),
        "step ms": 1e3 * statistics.median(steady or [0.0]),
        "GPU idle %": 100 * statistics.median(idle) if idle else 0.0,
    }


def _validated(llm: LLM, prompts, sp):
    from deepinfer_engine.validation import validate_requests

    eng = llm.engine
    return validate_requests(
        prompts, sp, eng.tokenizer.encode, eng.bundle.vocab_size, eng.max_model_len
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "slice"], choices=["tiny", "slice"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--slice-experts", type=int, default=16)
    args = ap.parse_args()
    accel = "nvidia" if args.device == "cuda" else "cpu"
    rows = []
    for name in args.models:
        t = time.perf_counter()
        if name == "tiny":
            llm = LLM(
                None, accelerator=accel, max_num_seqs=max(args.batches), gpu_memory_utilization=0.5
            )
        else:
            llm = LLM.from_bundle(
                slice_bundle(args.device, args.slice_experts),
                accelerator=accel,
                max_num_seqs=max(args.batches),
                max_model_len=4096,
                gpu_memory_utilization=0.5,
            )
        print(f"# {name}: built in {time.perf_counter() - t:.1f}s on {args.device}", flush=True)
        probe = Probe(llm)
        # Warm-up (lazy CUDA init, kernel compilation, pinned buffers), not reported.
        for b in args.batches:
            run_one(llm, probe, b, args.prompt_len, 2, True)
        for b in args.batches:
            for async_on in (True, False):
                r = run_one(llm, probe, b, args.prompt_len, args.max_tokens, async_on)
                rows.append((name, b, "on" if async_on else "off", r))
                print(f"#   {name} B={b} async={'on' if async_on else 'off'}: {r}", flush=True)
        del llm  # give the KV cache and weights back before the next model
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"\nengine benchmark on {dev}: prompt {args.prompt_len} tokens, "
        f"{args.max_tokens} new tokens, temperature 0.8 top-p 0.95 seeded"
    )
    print(
        f"{'model':6} {'batch':>5} {'async':>5} {'tok/s':>9} {'host ms/step':>13} "
        f"{'step ms':>9} {'GPU idle %':>10}"
    )
    for name, b, a, r in rows:
        print(
            f"{name:6} {b:5d} {a:>5} {r['tok/s']:9.1f} {r['host ms/step']:13.2f} "
            f"{r['step ms']:9.2f} {r['GPU idle %']:10.1f}"
        )


if __name__ == "__main__":
    main()
