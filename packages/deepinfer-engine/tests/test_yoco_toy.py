"""SWA bounded replay (YOCO prefill truncation): what the engine asks of the model, over the toy.

The toy stands in for the model's truncated semantics ("encoder-only" update on the skipped
tokens); the engine must mark exactly the prompt positions < N - K, whatever the chunking or
preemption, pass the mode (`mask` or `compact`) on, and mark nothing in `off` mode.
"""

from __future__ import annotations

import pytest
from deepinfer_engine.llm import LLM
from deepinfer_sampling.params import SamplingParams
from test_engine_toy import PROMPTS
from toy import ToyModel, greedy_reference

K = 10  # >= toy window 8 + backtracking (use_nextn_decode 1 + 1)


def make(mode, **kw):
    return LLM.from_model(
        ToyModel(yoco=True),
        accelerator="cpu",
        dtype="float32",
        block_size=4,
        yoco_prefill_truncation_mode=mode,
        yoco_prefill_keep_tokens=K,
        use_nextn_decode=1,
        **kw,
    )


@pytest.mark.parametrize("mode", ["compact", "mask"])
@pytest.mark.parametrize("budget", [3, 16, 512])
def test_truncation_marks_exactly_prompt_positions_before_n_minus_k(budget, mode):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = make(mode, max_num_batched_tokens=budget)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert llm.engine.model.truncations == {mode}  # the model is told how to truncate
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.outputs[0].token_ids == greedy_reference(p, 6, ignore_eos=True, keep=K)
    # a prompt longer than K really is truncated (the toy's outputs differ from `off`)
    long = PROMPTS[4]
    assert greedy_reference(long, 6, True, keep=K) != greedy_reference(long, 6, True)


def test_off_is_exact_and_short_prompts_behave_as_off():
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    off = make("off").generate(PROMPTS, sp, use_tqdm=False)
    comp = make("compact").generate(PROMPTS, sp, use_tqdm=False)
    for p, a, b in zip(PROMPTS, off, comp, strict=True):
        assert a.outputs[0].token_ids == greedy_reference(p, 6, ignore_eos=True)
        if len(p) <= K:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_compact_with_preemption_is_unchanged():
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = make("compact", kv_cache_bytes=2 * 4096 + 24 * 1024, max_num_seqs=8, max_model_len=64)
    outs = llm.generate(PROMPTS[1:], sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(PROMPTS[1:], outs, strict=True):
        assert o.outputs[0].token_ids == greedy_reference(p, 20, ignore_eos=True, keep=K)


def test_keep_tokens_too_small_and_missing_model_support():
    with pytest.raises(ValueError, match=r"yoco_prefill_keep_tokens.*window \(8\).*= 14"):
        LLM.from_model(
            ToyModel(yoco=True),
            accelerator="cpu",
            yoco_prefill_truncation_mode="compact",
            yoco_prefill_keep_tokens=13,
        )
    with pytest.raises(NotImplementedError, match="yoco_floor"):
        LLM.from_model(
            ToyModel(yoco=False),
            accelerator="cpu",
            yoco_prefill_truncation_mode="compact",
            yoco_prefill_keep_tokens=140,
        )
