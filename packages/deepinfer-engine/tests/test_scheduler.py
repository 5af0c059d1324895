"""Scheduler + KV cache manager + output processor, driven by a simulated model (no torch model
needed).

The simulated model keeps, per slot, the tokens written at each position, and its "next token"
is a hash of the slot's contents. So a wrong schedule (a stale slot after preemption, a chunk at
the wrong offset, a missing prefill token) changes the tokens, and the result must equal a plain
loop `next = f(all tokens so far)` for each prompt alone.
"""

from __future__ import annotations

import math

import pytest
from deepinfer_engine.kv_cache_manager import KVCacheManager, plan_cache
from deepinfer_engine.output_processor import OutputProcessor, RowResult
from deepinfer_engine.scheduler import Scheduler, SchedulerOutput
from deepinfer_engine.sequence import Sequence
from deepinfer_sampling.params import SamplingParams
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB = 50
EOS = 0


def next_token(tokens: list[int]) -> int:
    h = 1469598103934665603
    for t in tokens:
        h = ((h ^ t) * 1099511628211) % (1 << 64)
    return h % VOCAB


def reference(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    toks, out = list(prompt), []
    while True:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if t == EOS or len(out) >= max_tokens or len(toks) >= max_model_len:
            return out


class SimModel:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int):
        self.slots: dict[int, list[int]] = {}
        self.block_owner = [-1] * num_blocks
        self.block_size = block_size

    def run(self, out: SchedulerOutput, prev: dict[int, int]) -> list[RowResult | None]:
        for s in out.new_slots:
            self.slots[s] = []
        results = []
        for c in out.chunks:
            hist = self.slots[c.seq.slot]
            assert len(hist) == c.start, "chunk does not continue the slot's history"
            ids = [prev[c.seq.seq_id] if t == -1 else t for t in c.token_ids]
            assert all(t >= 0 for t in ids)
            # every position written must have a page of this sequence
            assert len(c.seq.block_table) >= math.ceil((c.start + c.num_tokens) / self.block_size)
            hist.extend(ids)
            results.append(RowResult(token_id=next_token(hist)) if c.sample else None)
        return results


def check_kv_invariants(sched: Scheduler, kv: KVCacheManager):
    used = [b for s in sched.running for b in s.block_table]
    assert len(used) == len(set(used))
    assert len(used) + kv.num_free_blocks == kv.num_blocks
    slots = [s.slot for s in sched.running]
    assert len(slots) == len(set(slots)) and all(x >= 0 for x in slots)
    for s in sched.running:
        assert len(s.block_table) == math.ceil(s.num_computed_tokens / kv.block_size)
    for s in sched.waiting:
        assert s.slot == -1 and not s.block_table


def run_all(
    prompts, max_tokens, num_blocks, block_size, budget, max_seqs, async_mode, max_model_len=64
):
    kv = KVCacheManager(num_slots=max_seqs, num_blocks=num_blocks, block_size=block_size)
    sched = Scheduler(kv, max_seqs, budget)
    outputs = OutputProcessor(sched, EOS, max_model_len)
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(i, str(i), 0, list(p), SamplingParams(max_tokens=max_tokens))
        seqs.append(s)
        sched.add(s)
    model = SimModel(max_seqs, num_blocks, block_size)
    inflight: tuple[SchedulerOutput, list] | None = None
    sampled: dict[int, int] = {}
    steps = 0
    while sched.has_unfinished() or inflight:
        steps += 1
        assert steps < 5000, "no progress"
        out = sched.schedule()
        check_kv_invariants(sched, kv)
        results = model.run(out, sampled) if not out.is_empty else []
        if async_mode:
            if inflight is not None:
                outputs.update(*inflight)
            inflight = (out, results) if not out.is_empty else None
        else:
            outputs.update(out, results)
        sampled = {c.seq.seq_id: r.token_id for c, r in zip(out.chunks, results, strict=False) if r}
    return seqs, sched


prompt_st = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(prompt_st, min_size=1, max_size=6),
    max_tokens=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 4),
    async_mode=st.booleans(),
    extra_blocks=st.integers(0, 30),
)
def test_outputs_equal_plain_loop(
    prompts, max_tokens, block_size, budget, max_seqs, async_mode, extra_blocks
):
    max_model_len = 64
    num_blocks = math.ceil(max_model_len / block_size) + extra_blocks
    seqs, _ = run_all(
        prompts, max_tokens, num_blocks, block_size, budget, max_seqs, async_mode, max_model_len
    )
    for s, p in zip(seqs, prompts, strict=False):
        assert s.output_token_ids == reference(p, max_tokens, max_model_len)
        assert s.finish_reason in ("stop", "length")


def test_tiny_budget_preempts_and_keeps_tokens():
    prompts = [[i + 1] * 6 for i in range(5)]
    seqs, sched = run_all(
        prompts, 20, num_blocks=16, block_size=4, budget=64, max_seqs=4, async_mode=True
    )
    assert sched.num_preemptions > 0
    for s, p in zip(seqs, prompts, strict=False):
        assert s.output_token_ids == reference(p, 20, 64)


def test_decode_rows_come_first_and_prefill_is_chunked():
    kv = KVCacheManager(num_slots=4, num_blocks=64, block_size=4)
    sched = Scheduler(kv, 4, 8)
    outputs = OutputProcessor(sched, EOS, 256)
    a = Sequence(0, "a", 0, [1, 2, 3], SamplingParams(max_tokens=5))
    sched.add(a)
    out = sched.schedule()
    assert [(c.seq.seq_id, c.num_tokens, c.sample) for c in out.chunks] == [(0, 3, True)]
    outputs.update(out, [RowResult(token_id=7)])
    b = Sequence(1, "b", 0, list(range(1, 20)), SamplingParams(max_tokens=5))
    sched.add(b)
    out = sched.schedule()
    # a decodes 1 token; b gets the remaining 7 of the budget, no sample yet
    assert [(c.seq.seq_id, c.start, c.num_tokens, c.sample) for c in out.chunks] == [
        (0, 3, 1, True),
        (1, 0, 7, False),
    ]


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "stop_reason", "n_out"),
    [
        (SamplingParams(max_tokens=10), [5, EOS, 6], "stop", None, 2),
        (SamplingParams(max_tokens=10, ignore_eos=True), [5, EOS, 6], "length", None, 10),
        (SamplingParams(max_tokens=10, min_tokens=3), [EOS, EOS, EOS, EOS], "stop", None, 3),
        (SamplingParams(max_tokens=10, stop_token_ids=[6]), [5, 6, 7], "stop", 6, 2),
        (SamplingParams(max_tokens=3), [5, 5, 5, 5], "length", None, 3),
    ],
)
def test_stop_rules(params, tokens, reason, stop_reason, n_out):
    kv = KVCacheManager(num_slots=1, num_blocks=64, block_size=4)
    sched = Scheduler(kv, 1, 64)
    outputs = OutputProcessor(sched, EOS, 256)
    s = Sequence(0, "r", 0, [1, 2], params)
    sched.add(s)
    i = 0
    while not s.is_finished:
        out = sched.schedule()
        outputs.update(out, [RowResult(token_id=tokens[min(i, len(tokens) - 1)])])
        i += 1
    assert (s.finish_reason, s.stop_reason, len(s.output_token_ids)) == (reason, stop_reason, n_out)
    assert kv.num_free_blocks == 64 and kv.num_free_slots == 1


def test_error_row_ends_only_that_sequence():
    kv = KVCacheManager(num_slots=2, num_blocks=64, block_size=4)
    sched = Scheduler(kv, 2, 64)
    outputs = OutputProcessor(sched, EOS, 256)
    a = Sequence(0, "a", 0, [1], SamplingParams(max_tokens=3))
    b = Sequence(1, "b", 0, [2], SamplingParams(max_tokens=3))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    outputs.update(out, [RowResult(error="non-finite logits"), RowResult(token_id=4)])
    assert a.finish_reason == "error" and a.error == "non-finite logits"
    assert not b.is_finished and b.output_token_ids == [4]


def test_plan_cache_caps_max_model_len_and_rejects_tiny_budget():
    plan = plan_cache(
        10_000,
        bytes_per_slot=1000,
        bytes_per_block=500,
        block_size=4,
        max_num_seqs=8,
        max_model_len=1000,
    )
    assert plan.num_slots == 1 and plan.num_blocks == 18 and plan.max_model_len == 72
    plan = plan_cache(100_000, 1000, 500, 4, max_num_seqs=8, max_model_len=40)
    assert plan.num_slots == 8 and plan.num_blocks == (100_000 - 8000) // 500
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        plan_cache(1200, 1000, 500, 4, 8, 40)
