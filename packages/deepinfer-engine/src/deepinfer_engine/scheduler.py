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
be scheduled before this one's tokens are known. The output processor later resolves the
placeholders, appends the tokens, applies the stop rules, and has the scheduler `free` what
finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer_engine.kv_cache_manager import KVCacheManager
from deepinfer_engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of `seq` computed in this step.

    `sample`: the chunk reaches the last token, so a new token is sampled from its last row.
    `token_ids[i]` is -1 where the token is still in flight (async scheduling's placeholder); the
    runner takes those ids from the previous step's sampled tensor on the device.
    `prompt_logits`: positions [a, b) of the chunk whose logits give prompt logprobs (the
    logprob of prompt token j+1 at position j), None when none are wanted.
    """

    seq: Sequence
    start: int
    num_tokens: int
    token_ids: list[int]
    sample: bool
    prompt_logits: tuple[int, int] | None = None


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


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = min(max_num_seqs, kv.num_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

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
        out.chunks.append(
            ScheduledChunk(
                seq,
                start,
                n,
                seq.token_ids(start, start + n),
                sample,
                seq.prompt_logit_positions(start, start + n),
            )
        )
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

    # ---- release -----------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop a finished sequence from the queues and give back its slot and blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
