"""Continuous batching with chunked prefill, decode-first, and preemption by recompute.

One call to `schedule()` picks the work of one model step under two limits: a token budget
(`max_num_batched_tokens`) and the KV capacity (`KVCacheManager`). Order:
  1. running sequences with one token to compute (decode rows), oldest first;
  2. running sequences part-way through their prompt (the next prefill chunk);
  3. waiting sequences, first come first served, while a slot, blocks and budget remain.
When a running sequence needs a block and none is free, the most recently admitted running
sequence not yet scheduled in this step is preempted: its slot and blocks are freed and it goes
back to the front of the queue with its generated tokens kept, to be recomputed later. Its output
is unchanged because a token depends only on the token ids before it (and, when seeded, on its
seed and position), never on cache history.

`schedule()` advances `num_computed_tokens` at once (the step is as good as launched), and adds a
placeholder (`num_inflight`) for each sampled row, so that with async scheduling the next step can
be scheduled before this one's tokens are known. `update()` later resolves the placeholders,
appends the tokens and applies the stop rules.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer_engine.kv_cache_manager import KVCacheManager
from deepinfer_engine.outputs import Logprob
from deepinfer_engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of `seq` computed in this step.

    `sample`: the chunk reaches the last token, so a new token is sampled from its last row.
    `token_ids[i]` is -1 where the token is still in flight (async scheduling's placeholder); the
    runner takes those ids from the previous step's sampled tensor on the device.
    """

    seq: Sequence
    start: int
    num_tokens: int
    token_ids: list[int]
    sample: bool


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_slots: list[int] = field(default_factory=list)  # reset these slots before the step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class RowResult:
    """What the sampler produced for one sampled chunk.

    `error` (a message) ends that sequence with finish_reason="error" and no token appended.
    """

    token_id: int = -1
    logprob: float | None = None
    top_logprobs: dict[int, Logprob] | None = None
    error: str | None = None


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_id: int | None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = min(max_num_seqs, kv.num_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.num_generated = 0  # tokens appended to outputs

    # ---- queue -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        pending = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        pending += [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]

        while pending and budget > 0:
            seq = pending.pop(0)
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining <= 0:
                continue
            n = min(remaining, budget)
            while not self.kv.can_allocate(seq, n):
                # Preempt the youngest running sequence that is not in this step yet.
                victim = max(pending, key=self.running.index) if pending else seq
                if victim is not seq:
                    pending.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if self.kv.allocate(seq, n):
                out.new_slots.append(seq.slot)
            self._add_chunk(out, seq, n)
            budget -= n

        # Admit waiting sequences (FCFS) only if nothing was preempted: preemption means memory
        # is short, and admitting would just preempt again next step.
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            if seq.num_inflight:
                break  # preempted with a token still in flight: wait for it (FCFS)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.can_allocate(seq, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self.kv.allocate(seq, n):
                out.new_slots.append(seq.slot)
            self._add_chunk(out, seq, n)
            budget -= n
        return out

    def _add_chunk(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        sample = start + n == seq.num_tokens
        out.chunks.append(ScheduledChunk(seq, start, n, seq.token_ids(start, start + n), sample))
        seq.num_computed_tokens += n
        if sample:
            seq.num_inflight += 1

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free the sequence's cache and requeue it at the front; its tokens are kept."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # ---- update ------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, results: list[RowResult | None]) -> list[Sequence]:
        """Resolve the placeholders of step `out`: append sampled tokens and apply stop rules.

        `results[i]` belongs to `out.chunks[i]` (None for chunks that did not sample). Returns the
        sequences that finished in this update. Rows of sequences that finished earlier (async
        scheduling computes one step past a stop) are dropped.
        """
        finished: list[Sequence] = []
        for chunk, res in zip(out.chunks, results, strict=True):
            if not chunk.sample:
                continue
            seq = chunk.seq
            seq.num_inflight -= 1
            if seq.is_finished:
                continue
            assert res is not None
            if res.error is not None:
                self.finish(seq, "error", error=res.error)
                finished.append(seq)
                continue
            if seq.grammar is not None and not seq.grammar.accept_token(res.token_id):
                # The token was sampled under this grammar's mask, so a rejection is an engine
                # or grammar bug; it ends this request alone, without the rejected token.
                self.finish(
                    seq, "error", error=f"structured output: grammar rejected token {res.token_id}"
                )
                finished.append(seq)
                continue
            self._append(seq, res)
            if self._check_stop(seq, res.token_id):
                finished.append(seq)
        return finished

    def _append(self, seq: Sequence, res: RowResult) -> None:
        seq.output_token_ids.append(res.token_id)
        self.num_generated += 1
        if res.logprob is not None:
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + res.logprob
        if res.top_logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(res.top_logprobs)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Apply stop rules after appending `token`; finish the sequence if one fires.

        As in vLLM: EOS (unless ignore_eos) and stop ids end the output, keeping the token in
        `token_ids` but not rendering its text; the sampler masks them for the first
        `min_tokens` tokens. Stop strings must end after the text of the first `min_tokens`
        tokens, and are cut from the text. Then the length limits.
        """
        p = seq.params
        n_out = len(seq.output_token_ids)
        min_tokens = p.min_tokens
        # update() has had the grammar accept the token. A grammar that has matched to its end
        # (its stop token, EOS, accepted) ends the output.
        if seq.grammar is not None and seq.grammar.is_terminated():
            self.finish(seq, "stop")
            return True
        if n_out >= min_tokens:
            if not p.ignore_eos and token == self.eos_token_id:
                self.finish(seq, "stop")
                return True
            if token in p.stop_token_ids:
                self.finish(seq, "stop", stop_reason=token)
                return True
        if seq.detokenizer is not None:
            stop_str = seq.detokenizer.add_token(token, check_stop=n_out > min_tokens)
            if stop_str is not None:
                self.finish(seq, "stop", stop_reason=stop_str)
                return True
        max_tokens = p.max_tokens
        if (max_tokens is not None and n_out >= max_tokens) or (
            seq.num_known_tokens >= self.max_model_len
        ):
            self.finish(seq, "length")
            return True
        return False

    def finish(
        self,
        seq: Sequence,
        reason: str,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> None:
        """End a sequence now (stop rule, error, grammar end) and free its cache."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.error = error
        # A stop string already cut the text; otherwise emit any held-back partial character.
        if seq.detokenizer is not None and not isinstance(stop_reason, str):
            seq.detokenizer.flush()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
