"""vLLM's `prompt_logprobs` through the engine, over the toy model (whose logits are float64
math of the token history): every prompt token's logprob given the tokens before it, and the
top N, whatever the chunking, batch, preemption, async scheduling or SWA bounded replay."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.llm import LLM
from deepinfer_sampling.params import SamplingParams
from test_engine_toy import PROMPTS, make
from toy import VOCAB, ToyModel, greedy_reference, reference_logits

SP = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)


def expected(prompt: list[int], n: int) -> list[dict[int, tuple[float, int]] | None]:
    """[None, {token: (logprob, rank)} per later prompt token, with the top n]."""
    out: list[dict[int, tuple[float, int]] | None] = [None]
    for j in range(1, len(prompt)):
        lp = torch.log_softmax(reference_logits(prompt[:j]).float(), dim=0)
        entry = {prompt[j]: (float(lp[prompt[j]]), int((lp > lp[prompt[j]]).sum()) + 1)}
        values, ids = torch.topk(lp, n)
        for k, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
            entry.setdefault(t, (v, k + 1))
        out.append(entry)
    return out


def check(out, prompt, n=2):
    got = out.prompt_logprobs
    want = expected(prompt, n)
    assert len(got) == len(prompt) and got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert set(g) == set(w)
        for t, (lp, rank) in w.items():
            assert g[t].logprob == pytest.approx(lp, abs=1e-5) and g[t].rank == rank
            assert g[t].decoded_token == VOCAB[t]


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("budget", [1, 3, 7, 512])
def test_prompt_logprobs_under_any_chunking(budget, async_scheduling):
    llm = make(max_num_batched_tokens=budget, async_scheduling=async_scheduling)
    outs = llm.generate(PROMPTS, SP, use_tqdm=False)
    for p, o in zip(PROMPTS, outs, strict=True):
        check(o, p)
        assert o.outputs[0].token_ids == greedy_reference(p, 3)


def test_prompt_logprobs_only_where_asked_and_once_per_request():
    llm = make()
    plain = SamplingParams(temperature=0, max_tokens=3)
    many = SamplingParams(temperature=1.0, seed=5, max_tokens=3, n=3, prompt_logprobs=0)
    outs = llm.generate(PROMPTS[:3], [plain, many, SP], use_tqdm=False)
    assert outs[0].prompt_logprobs is None
    check(outs[1], PROMPTS[1], n=0)
    assert len(outs[1].outputs) == 3
    check(outs[2], PROMPTS[2])


def test_preemption_recomputes_without_repeating_prompt_logprobs():
    llm = make(kv_cache_bytes=2 * 4096 + 24 * 1024, max_num_seqs=8, max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(PROMPTS[:4], sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(PROMPTS[:4], outs, strict=True):
        check(o, p)


@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_a_request_with_prompt_logprobs_is_not_truncated(mode):
    # its prompt rows all need the whole model: it runs exact, the others truncated
    llm = LLM.from_model(
        ToyModel(yoco=True),
        accelerator="cpu",
        block_size=4,
        yoco_prefill_truncation_mode=mode,
        yoco_prefill_keep_tokens=10,
        use_nextn_decode=1,
    )
    long = PROMPTS[4]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    exact, cut = llm.generate([long, long], [sp.replace(prompt_logprobs=1), sp], use_tqdm=False)
    check(exact, long, n=1)
    assert exact.outputs[0].token_ids == greedy_reference(long, 4, ignore_eos=True)
    assert cut.outputs[0].token_ids == greedy_reference(long, 4, ignore_eos=True, keep=10)
