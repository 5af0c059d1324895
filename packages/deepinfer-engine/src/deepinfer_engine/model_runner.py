"""ModelRunner: turns a scheduled step into one `Model.forward` and one `Sampler` call.

A step is split in two so that async scheduling can overlap host work with the device:
  * `launch(out, prev)` builds the flat `ForwardBatch` with the model package's builder
    (`deepinfer_model.batch.build_batch`: one pinned non-blocking upload plus the CPU mirror, so
    the model's forward never reads the device back) and enqueues the forward. Tokens still in
    flight (placeholders, -1 on the host) are copied on the device from `prev`, the previous
    step's sampled-id tensor, so launching never waits for the previous step's result.
  * `sample(step, rows)` runs the sampler on the step's logits (after the host has filled the
    grammar bitmasks, which needs the previous tokens) and starts a non-blocking copy of the
    results to the host; `resolve(sample)` waits for that copy only.
On CPU everything is synchronous and the same code runs.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
from deepinfer_kernels import REGISTRY
from deepinfer_model.batch import SequenceInput, build_batch
from deepinfer_model.cuda_graph import GraphCaptureError
from deepinfer_parallel.step_sync import StepPlan

from deepinfer_engine import prompt_logprobs
from deepinfer_engine.engine_model import EngineModel
from deepinfer_engine.output_processor import RowResult
from deepinfer_engine.outputs import logprob_entry
from deepinfer_engine.prompt_logprobs import PromptLogits
from deepinfer_engine.scheduler import ScheduledChunk, SchedulerOutput
from deepinfer_engine.step_peers import StepPeers

logger = logging.getLogger("deepinfer.engine")


@dataclass
class LaunchedStep:
    """A step whose forward has been enqueued.

    logits: [R, vocab] for the sampled chunks (R = number of chunks with `sample`), in chunk
    order; `sample_chunks[i]` is the chunk of logits row i. prompt: the prompt logprobs the
    step computes (`prompt_logprobs.PromptLogits`), None when no chunk asks for them.
    """

    out: SchedulerOutput
    logits: torch.Tensor | None
    sample_chunks: list[ScheduledChunk]
    prompt: PromptLogits | None = None


@dataclass
class SampledStep:
    """Sampled ids on the device plus their pending host copies.

    row_of_seq: seq_id -> row in `token_ids` (for placeholders of the next step).
    """

    launched: LaunchedStep
    token_ids: torch.Tensor  # [S] int64 on the device, S = rows actually sampled
    row_of_seq: dict[int, int]
    host: dict[str, torch.Tensor]
    event: torch.cuda.Event | None


class ModelRunner:
    def __init__(
        self,
        model: EngineModel,
        num_blocks: int,
        num_slots: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        yoco: tuple[int, str] | None = None,
        graph_max_batch: int = 0,
        peers: StepPeers | None = None,
    ) -> None:
        """yoco: YOCO prefill truncation, (K, how: "compact" | "mask", as
        `ForwardBatch.yoco_truncation`), None when off; graph_max_batch: decode steps of up
        to this many sequences replay CUDA graphs (on CUDA, when the model offers them;
        0 = always eager). peers: this is one rank of several (its model is sharded: forwards
        pad their collectives to the step's agreed rows)."""
        from deepinfer_sampling.sampler import Sampler

        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.spec = model.cache_spec(block_size, dtype)
        self.cache = model.make_cache(self.spec, num_blocks, num_slots, device, dtype)
        self.sampler = Sampler()
        # Fresh randomness for unseeded rows; seeded from the engine seed so whole runs repeat.
        gen_device = device if device.type == "cuda" else torch.device("cpu")
        self.generator = torch.Generator(device=gen_device)
        self.generator.manual_seed(seed)
        # YOCO truncation: the consumer layers fully run each prompt's last K tokens only
        self.keep_tokens, self.truncation = yoco if yoco is not None else (None, "compact")
        self.peers = peers
        self.graphs = None
        self._bucket_for = None  # with peers and graphs: the bucket every rank pads decode to
        if device.type == "cuda" and graph_max_batch > 0:
            self.graphs = model.decode_graphs(graph_max_batch)
        if self.graphs is not None and peers is not None:
            # every rank captures every bucket now, together (collectives inside the pieces)
            self._bucket_for = self.graphs.bucket_for
            try:
                self.graphs.capture_all()
            except GraphCaptureError as e:
                logger.warning("CUDA graphs switched off, decode runs eagerly: %s", e)
                self.graphs = None

    # ---- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, prev: SampledStep | None, collective_rows: int | None = None
    ) -> LaunchedStep:
        """Build the flat batch of `out` and enqueue the model's forward (its collectives padded
        to `collective_rows`, the step's agreed count, when the engine has peers)."""
        for slot in out.new_slots:
            self.cache.reset_slot(slot)
        sample_chunks = [c for c in out.chunks if c.sample]
        rows = prompt_logprobs.prompt_rows(out.chunks)
        if rows:  # after the sampled rows (one per sampled chunk, its last)
            ends = itertools.accumulate(c.num_tokens for c in out.chunks)
            rows = [e - 1 for c, e in zip(out.chunks, ends, strict=True) if c.sample] + rows
        batch = build_batch(
            [self._sequence_input(c, prev) for c in out.chunks],
            self.device,
            prev_token_ids=prev.token_ids if prev is not None else None,
            logits_rows=rows or None,
            yoco_truncation=self.truncation,
        )
        batch.collective_rows = collective_rows
        # Prefill chunks that sample nothing still run: they write their KV into the cache.
        res = None
        if self.graphs is not None and self.graphs.unsupported(batch) is None:
            try:
                res = self.graphs.forward(batch, self.cache)
            except GraphCaptureError as e:  # nothing of the step ran: it goes eager
                logger.warning("CUDA graphs switched off, decode runs eagerly: %s", e)
                self.graphs = None
        if res is None:
            res = self.model.forward(batch, self.cache)
        n = len(sample_chunks)
        prompt = prompt_logprobs.start(res.logits[n:], out.chunks) if rows else None
        return LaunchedStep(out, res.logits[:n] if n else None, sample_chunks, prompt)

    def collective_rows(self, plan: StepPlan) -> int:
        """The rows every rank's collectives use this step: the agreed count, rounded up to a
        decode graph bucket on a decode step when graphs are on (every rank computes the same,
        whether or not its own batch replays a graph)."""
        # batch-invariant steps are never graphed
        graphed = self._bucket_for is not None and not REGISTRY.batch_invariant
        if plan.rows and graphed and not plan.prefill:
            bucket = self._bucket_for(plan.rows)
            if bucket is not None:
                return bucket
        return plan.rows

    @torch.inference_mode()
    def idle(self, rows: int) -> None:
        """This rank scheduled nothing: take part in the step's collectives (`rows` agreed)."""
        self.model.idle_forward(rows)

    def _sequence_input(self, c: ScheduledChunk, prev: SampledStep | None) -> SequenceInput:
        """Chunk `c` as the batch builder takes it; its token in flight (if any) is the one
        `prev` sampled for its sequence."""
        prev_row = None
        if any(t < 0 for t in c.token_ids):
            if prev is None or c.seq.seq_id not in prev.row_of_seq:
                raise RuntimeError(
                    f"placeholder for sequence {c.seq.seq_id} without a previous sample"
                )
            prev_row = prev.row_of_seq[c.seq.seq_id]
        floor = self._yoco_floor(c) if self.keep_tokens is not None else None
        return SequenceInput(
            c.token_ids, c.start, c.seq.slot, c.seq.block_table, c.sample, floor, prev_row
        )

    def _yoco_floor(self, c: ScheduledChunk) -> int:
        """YOCO prefill truncation: the first position the consumer layers fully run.

        A prompt of N > K tokens is truncated below position N - K; shorter prompts are exact
        (0). N is the *original* prompt length for the sequence's whole life (prompt chunks,
        decode steps, and recompute after preemption), as the model requires. A sequence that
        computes prompt logprobs is exact (0): each of its prompt rows needs every layer.
        """
        assert self.keep_tokens is not None
        if c.seq.wants_prompt_logprobs:
            return 0
        return max(0, c.seq.num_prompt_tokens - self.keep_tokens)

    # ---- sampling ----------------------------------------------------------------------------
    @torch.inference_mode()
    def sample(self, step: LaunchedStep, eos_token_ids: tuple[int, ...]) -> SampledStep | None:
        """Sample the step's rows whose sequences are still live; start the copy to the host.

        Must be called after the previous step's tokens were resolved (grammar matchers,
        penalties and min_tokens read the sequences' output tokens). Fills grammar bitmasks here.
        """
        from deepinfer_sampling.batch import SamplingBatch, SamplingRow

        live = [i for i, c in enumerate(step.sample_chunks) if not c.seq.is_finished]
        if not live or step.logits is None:
            return None
        rows = []
        for i in live:
            c = step.sample_chunks[i]
            seq = c.seq
            position = c.start + c.num_tokens
            assert position == seq.num_known_tokens, "sampling before the last token is known"
            rows.append(
                SamplingRow(
                    params=seq.params,
                    position=position,
                    output_token_ids=seq.output_token_ids,
                    grammar=seq.grammar,
                )
            )
        logits = step.logits
        if len(live) != logits.shape[0]:
            keep = torch.tensor(live, dtype=torch.int64)
            if logits.device.type == "cuda":
                keep = keep.pin_memory()  # a pageable copy would make the host wait
            logits = logits[keep.to(logits.device, non_blocking=True)]
        batch = SamplingBatch.build(
            rows, vocab_size=logits.shape[1], device=logits.device, eos_token_ids=eos_token_ids
        )
        so = self.sampler(logits, batch, generator=self.generator)
        # Per-row health, computed on the device so nothing waits: a NaN or +inf logit, a row
        # that is -inf everywhere, or a grammar that allows no token at all (a dead end), ends
        # that request alone. A -inf on some tokens is a valid distribution (masked entries).
        # One reduction: a row's max is NaN if any entry is (max propagates NaN), +inf if any
        # entry is, and -inf only if every entry is.
        row_max = logits.amax(dim=1)
        finite = (row_max > float("-inf")) & (row_max < float("inf"))
        # The sampler's check sees every mask together (a grammar whose only allowed token is
        # an EOS that min_tokens masks is a dead end too).
        grammar_ok = so.has_allowed if so.has_allowed is not None else torch.ones_like(finite)
        host = {"token_ids": so.token_ids, "finite": finite, "grammar_ok": grammar_ok}
        if so.logprobs is not None:
            host["logprobs"] = so.logprobs
            host["ranks"] = so.ranks
            host["top_logprobs"] = so.top_logprobs
            host["top_token_ids"] = so.top_token_ids
        if self.peers is not None:
            self.peers.share_samples(host)  # a DP follower takes its leader's tokens
        event = None
        if logits.device.type == "cuda":
            host = {k: v.to("cpu", non_blocking=True) for k, v in host.items()}
            event = torch.cuda.Event()
            event.record()
        row_of_seq = {step.sample_chunks[i].seq.seq_id: r for r, i in enumerate(live)}
        return SampledStep(step, so.token_ids, row_of_seq, host, event)

    def resolve(self, sampled: SampledStep | None, step: LaunchedStep) -> list[RowResult | None]:
        """Wait for the host copies of `sampled` and of the step's prompt logprobs and turn
        them into one result per chunk of `step` (None: a chunk with nothing to report)."""
        prompt = (
            prompt_logprobs.resolve(step.prompt, step.out.chunks) if step.prompt is not None else {}
        )
        results = self._resolve_samples(sampled, step)
        for i, entries in prompt.items():
            if results[i] is None:
                results[i] = RowResult()
            results[i].prompt_logprobs = entries
        return results

    def _resolve_samples(
        self, sampled: SampledStep | None, step: LaunchedStep
    ) -> list[RowResult | None]:
        results: list[RowResult | None] = [
            RowResult() if c.sample else None for c in step.out.chunks
        ]
        if sampled is None:
            return results
        if sampled.event is not None:
            sampled.event.synchronize()
        h = sampled.host
        tokens = h["token_ids"].tolist()
        finite = h["finite"].tolist()
        grammar_ok = h["grammar_ok"].tolist()
        lp = ranks = top_lp = top_ids = None
        if "logprobs" in h:  # sample() copies the four together
            lp, ranks, top_lp, top_ids = (
                h[k].tolist() for k in ("logprobs", "ranks", "top_logprobs", "top_token_ids")
            )
        index_of_chunk = {id(c): i for i, c in enumerate(step.out.chunks)}
        for c in step.sample_chunks:
            r = sampled.row_of_seq.get(c.seq.seq_id)
            if r is None:
                continue  # the sequence finished before this step was sampled
            res = RowResult(token_id=tokens[r])
            if not finite[r]:
                res = RowResult(
                    error="the model produced non-finite logits (NaN, +inf, or -inf everywhere)"
                )
            elif not grammar_ok[r]:
                res = RowResult(
                    error="structured output dead end: the grammar allows no token at this point "
                    "(or only EOS/stop ids, which min_tokens masks)"
                )
            elif lp is not None and c.seq.params.logprobs is not None:
                res.logprob = lp[r]
                n = c.seq.params.logprobs  # <= the vocabulary (validate_requests)
                res.top_logprobs = logprob_entry(
                    tokens[r], lp[r], ranks[r], top_ids[r][:n], top_lp[r][:n]
                )
            results[index_of_chunk[id(c)]] = res
        return results
