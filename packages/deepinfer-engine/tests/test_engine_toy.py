"""The whole engine (LLM -> scheduler -> runner -> sampler) over the toy model."""

from __future__ import annotations

import pytest
from deepinfer_engine.llm import LLM
from deepinfer_sampling.params import SamplingParams
from toy import EOS, NAN_TOKEN, VOCAB, ToyModel, greedy_reference

PROMPTS = [[3, 4, 5], [7] * 11, [9, 2, 30, 31, 8, 6], [12], list(range(2, 40))]


def make(**kw):
    kw.setdefault("accelerator", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    return LLM.from_model(ToyModel(), **kw)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_equals_plain_loop_and_batch_equals_alone(async_scheduling):
    llm = make(async_scheduling=async_scheduling)
    sp = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.outputs[0].token_ids == greedy_reference(p, 12)
        assert o.finished and o.prompt_token_ids == p
        alone = llm.generate([p], sp, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == o.outputs[0].token_ids


def test_async_on_equals_off_with_seeded_sampling():
    sp = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=10, n=2)
        for i in range(len(PROMPTS))
    ]
    on = make(async_scheduling=True).generate(PROMPTS, sp, use_tqdm=False)
    off = make(async_scheduling=False).generate(PROMPTS, sp, use_tqdm=False)
    assert tokens(on) == tokens(off)
    # seeded: the same in another batch composition, and n>1 completions differ in stream
    again = make().generate(PROMPTS[::-1], sp[::-1], use_tqdm=False)[::-1]
    assert tokens(again) == tokens(on)


@pytest.mark.parametrize("budget", [1, 3, 7, 64])
def test_chunked_prefill_budgets_give_same_tokens(budget):
    sp = SamplingParams(temperature=0, max_tokens=8)
    outs = make(max_num_batched_tokens=budget).generate(PROMPTS, sp, use_tqdm=False)
    assert tokens(outs) == [[greedy_reference(p, 8)] for p in PROMPTS]


def test_preemption_under_tiny_budget_gives_same_tokens():
    # 2 slots worth of state + a handful of 4-token blocks: sequences must be preempted.
    llm = make(kv_cache_bytes=2 * 4096 + 24 * 1024, max_num_seqs=8, max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(PROMPTS[:4], sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == [[greedy_reference(p, 30, ignore_eos=True)] for p in PROMPTS[:4]]


def test_stop_strings_and_text():
    llm = make()
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate([PROMPTS[2]], sp, use_tqdm=False)[0].outputs[0]
    text = full.text
    assert text == "".join(VOCAB[t] for t in full.token_ids if t > 1)
    if len(text) >= 4:
        stop = text[2:4]
        cut = llm.generate([PROMPTS[2]], sp.replace(stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert cut.text == text[: text.find(stop)] and cut.stop_reason == stop
        assert cut.finish_reason == "stop"


def test_eos_and_logprobs():
    llm = make()
    sp = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    for p, o in zip(PROMPTS, llm.generate(PROMPTS, sp, use_tqdm=False), strict=True):
        c = o.outputs[0]
        ref = greedy_reference(p, 40)
        assert c.token_ids == ref
        assert c.finish_reason == ("stop" if ref[-1] == EOS else "length")
        assert len(c.logprobs) == len(ref) and c.cumulative_logprob <= 0
        for t, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert t in lp and lp[t].logprob <= 0


def test_bad_input_raises_before_any_work():
    llm = make(max_model_len=32)
    with pytest.raises(ValueError, match="prompt 1: empty prompt"):
        llm.generate(["abc", ""], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 2: prompt has 40"):
        llm.generate(["a", "b", "a" * 40], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0: token id 999 is outside the vocabulary"):
        llm.generate([[3, 999]], use_tqdm=False)
    assert llm.engine.stats.steps == 0 and not llm.engine.has_unfinished()


def test_non_finite_logits_end_only_that_request():
    llm = make()
    sp = SamplingParams(temperature=0, max_tokens=5)
    bad = [3, NAN_TOKEN]
    outs = llm.generate([PROMPTS[0], bad, PROMPTS[2]], sp, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "non-finite" in outs[1].outputs[0].error
    assert outs[0].outputs[0].token_ids == greedy_reference(PROMPTS[0], 5)
    assert outs[2].outputs[0].token_ids == greedy_reference(PROMPTS[2], 5)


def test_each_engine_runs_its_steps_in_its_own_kernel_mode():
    """Two engines in one process: every forward runs under the kernel settings its own engine
    was built with (argument or env), whichever engine was built last."""
    from deepinfer_kernels import REGISTRY

    seen: list[tuple[bool, bool]] = []

    def recording(batch_invariant: bool):
        llm = make(batch_invariant=batch_invariant)
        model = llm.engine.model
        forward = model.forward

        def spy(batch, cache):
            seen.append((batch_invariant, REGISTRY.batch_invariant))
            return forward(batch, cache)

        model.forward = spy
        return llm

    first = recording(True)
    second = recording(False)
    sp = SamplingParams(temperature=0, max_tokens=3)
    for llm in (first, second, first):
        llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    assert {built for built, _ in seen} == {True, False}
    assert all(built == ran for built, ran in seen), seen
    assert REGISTRY.batch_invariant is False  # outside a step: the defaults
