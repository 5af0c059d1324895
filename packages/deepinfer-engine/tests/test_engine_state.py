"""Engine state across and after `generate` calls: nothing leaks, a failed call leaves it clean."""

from __future__ import annotations

import math

import pytest
from deepinfer_engine.llm import LLM
from deepinfer_sampling.params import SamplingParams
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import NAN_TOKEN, VOCAB, ToyModel, greedy_reference

PROMPTS = [[3, 4, 5], [7] * 11, [9, 2, 30, 31, 8, 6], [12], list(range(2, 40))]


def make(model=None, **kw):
    kw.setdefault("accelerator", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    return LLM.from_model(model or ToyModel(), **kw)


def assert_idle(llm: LLM) -> None:
    """Every slot and block is back in the free lists and nothing is queued or in flight."""
    eng = llm.engine
    assert eng.kv.num_free_slots == eng.kv.num_slots
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert sorted(eng.kv._free_slots) == list(range(eng.kv.num_slots))  # no duplicates
    assert sorted(eng.kv._free_blocks) == list(range(eng.kv.num_blocks))
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert eng._inflight is None and not eng.has_unfinished()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_all_slots_and_blocks_free_after_generate(async_scheduling):
    # Tiny budget (preemption), n > 1, stop strings/ids, EOS, max_model_len, and an error row.
    llm = make(
        kv_cache_bytes=2 * 4096 + 24 * 1024,
        max_num_seqs=8,
        max_model_len=40,
        async_scheduling=async_scheduling,
    )
    sps = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(n=3, seed=5, max_tokens=12, stop=["a"]),
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(n=2, max_tokens=8, stop_token_ids=[5, 9], logprobs=1),
    ]
    prompts = [*PROMPTS[:4], [3, NAN_TOKEN]]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert outs[4].outputs[0].finish_reason == "error"
    assert all(c.finish_reason is not None for o in outs for c in o.outputs)
    assert_idle(llm)


def test_logprobs_of_the_whole_vocabulary():
    llm = make()
    sp = SamplingParams(temperature=0, max_tokens=3, logprobs=len(VOCAB))  # more is refused
    c = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == greedy_reference(PROMPTS[0], 3)
    assert [len(lp) for lp in c.logprobs] == [len(VOCAB)] * 3
    assert_idle(llm)


class FailingModel(ToyModel):
    """The toy model, raising on its `fail_at`-th forward call (an OOM, a kernel error...)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.calls = 0
        self.fail_at = fail_at

    def forward(self, batch, cache):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("device error")
        return super().forward(batch, cache)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_exception_mid_generate_leaves_the_engine_clean(async_scheduling):
    llm = make(FailingModel(fail_at=3), async_scheduling=async_scheduling, max_num_batched_tokens=8)
    sp = SamplingParams(temperature=0, max_tokens=6)
    with pytest.raises(RuntimeError, match="device error"):
        llm.generate(PROMPTS, sp, use_tqdm=False)
    assert_idle(llm)
    # The next call runs only its own requests and gives the same tokens as a fresh engine.
    outs = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy_reference(p, 6) for p in PROMPTS[:2]]
    assert_idle(llm)


def test_max_model_len_above_the_models_limit_is_an_error():
    with pytest.raises(ValueError, match=r"max_model_len=1000 .*max_position_embeddings \(256\)"):
        make(max_model_len=1000)
    assert make(max_model_len=256).engine.max_model_len == 256


def test_sampled_token_logprob_carries_its_rank():
    # vLLM: the sampled token's Logprob has its rank in the raw distribution (1 = most likely),
    # also when it is not among the top N.
    import torch
    from toy import reference_logits

    llm = make()
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=8, logprobs=1, ignore_eos=True)
    c = llm.generate([PROMPTS[2]], sp, use_tqdm=False)[0].outputs[0]
    toks = list(PROMPTS[2])
    for t, lp in zip(c.token_ids, c.logprobs, strict=True):
        ref = reference_logits(toks)
        assert lp[t].rank == 1 + int((ref > ref[t]).sum())
        assert math.isclose(lp[t].logprob, float(torch.log_softmax(ref, 0)[t]), abs_tol=1e-4)
        toks.append(t)


class MaskedVocabModel(ToyModel):
    """The toy model with -inf logits for a few tokens (as a model masking padded vocabulary
    entries does): a legitimate distribution, not a failure."""

    MASKED = (40, 41, 42)

    def forward(self, batch, cache):
        out = super().forward(batch, cache)
        out.logits[:, list(self.MASKED)] = float("-inf")
        return out


def test_minus_inf_logits_are_not_an_error_but_nan_is():
    llm = make(MaskedVocabModel())
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=1)
    outs = llm.generate([PROMPTS[0], [3, NAN_TOKEN]], sp, use_tqdm=False)
    good, bad = outs[0].outputs[0], outs[1].outputs[0]
    assert good.finish_reason in ("stop", "length") and good.error is None
    assert len(good.token_ids) >= 1 and not set(good.token_ids) & set(MaskedVocabModel.MASKED)
    assert bad.finish_reason == "error" and "non-finite" in bad.error
    assert_idle(llm)


@st.composite
def mixed_requests(draw):
    """Prompts with a mix of sampling settings (n, seeds, stops, min_tokens, penalties...)."""
    prompts, params = [], []
    for _ in range(draw(st.integers(1, 5))):
        prompts.append(draw(st.lists(st.integers(2, len(VOCAB) - 1), min_size=1, max_size=14)))
        max_tokens = draw(st.integers(1, 16))
        params.append(
            SamplingParams(
                n=draw(st.integers(1, 2)),
                temperature=draw(st.sampled_from([0.0, 0.8])),
                seed=draw(st.integers(0, 1000)),
                max_tokens=max_tokens,
                min_tokens=draw(st.integers(0, max_tokens)),
                stop=draw(st.sampled_from([(), ("a",), ("b ", "9")])),
                stop_token_ids=draw(st.sampled_from([(), (5,)])),
                ignore_eos=draw(st.booleans()),
                logprobs=draw(st.sampled_from([None, 1])),
                presence_penalty=draw(st.sampled_from([0.0, 0.5])),
            )
        )
    return prompts, params


@settings(max_examples=8, deadline=None)
@given(case=mixed_requests())
def test_outputs_do_not_depend_on_scheduling_and_nothing_leaks(case):
    # Same results with async on/off, a tight KV budget (preemption) and a tiny token budget
    # (chunked prefill); a second call on the same engine repeats them (seeded); all freed.
    prompts, params = case

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle(llm)
        return [
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.error) for c in o.outputs]
            for o in outs
        ]

    common = {"max_model_len": 40, "max_num_seqs": 8}
    ref_llm = make(**common)
    ref = run(ref_llm)
    assert run(ref_llm) == ref
    assert run(make(async_scheduling=False, **common)) == ref
    assert run(make(kv_cache_bytes=2 * 4096 + 14 * 1024, **common)) == ref
    assert run(make(max_num_batched_tokens=3, async_scheduling=False, **common)) == ref


def _char(t: int) -> str:
    return "" if t < 2 else VOCAB[t]  # the toy decodes specials (<bos>, <eos>) to nothing


def test_stop_token_id_is_in_token_ids_but_not_in_text():
    # vLLM: a request ended by EOS or a stop token id keeps the token in token_ids; its text is
    # not rendered (include_stop_str_in_output=False).
    llm = make()
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate([PROMPTS[2]], base, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = next(t for t in full[1:] if t >= 2)
    k = full.index(stop_id)
    c = llm.generate([PROMPTS[2]], base.replace(stop_token_ids=[stop_id]), use_tqdm=False)[0]
    c = c.outputs[0]
    assert c.token_ids == full[: k + 1] and c.stop_reason == stop_id
    assert c.text == "".join(_char(t) for t in full[:k])


@pytest.mark.parametrize("min_tokens", [1, 2, 3])
def test_stop_strings_only_match_text_after_min_tokens(min_tokens):
    # vLLM: the text of the first min_tokens tokens is not searched for stop strings (a stop
    # string must end after it), so at least min_tokens tokens are in the output.
    llm = make()
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate([PROMPTS[0]], base, use_tqdm=False)[0].outputs[0].token_ids
    stop = next(_char(t) for t in full if t >= 2)
    sp = base.replace(stop=[stop], min_tokens=min_tokens)
    c = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0]
    hits = [k for k, t in enumerate(full) if k >= min_tokens and _char(t) == stop]
    if hits:
        k = hits[0]
        assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", stop, full[: k + 1])
        assert c.text == "".join(_char(t) for t in full[:k])
    else:
        assert (c.finish_reason, c.token_ids) == ("length", full)
