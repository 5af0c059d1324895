"""vLLM's `prompt_logprobs` over the built-in tiny V4.1 checkpoint: the log-softmax of the
model's own prefill logits at every prompt position, whatever the chunking or batch; so a
prompt's perplexity is measured through the public API."""

from __future__ import annotations

import math

import pytest
import torch
from _tiny_llm import tiny_llm
from deepinfer import SamplingParams
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache

PROMPT = "The capital of France is a city that"
OTHERS = ["Hello, my name is", "1 2 3 4 5 6 7 8 9"]
N = 3


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


def prefill_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every prompt position, one forward."""
    model, cfg = llm.engine.model.model, llm.engine.model.config
    blocks = -(-len(ids) // 8)
    spec = CacheSpec.from_config(cfg, block_size=8, dtype=torch.float32)
    cache = KVCache(cfg, spec, blocks, 1, device="cpu", dtype=torch.float32)
    batch = ForwardBatch.build([ids], [0], [0], [list(range(blocks))], logits_rows="all")
    with torch.inference_mode():
        return torch.log_softmax(model.forward(batch, cache).logits, dim=-1)


def assert_matches(out, ref: torch.Tensor, n: int = N):
    ids = out.prompt_token_ids
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        row, entry = ref[j - 1], got[j]
        tok = ids[j]
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-5)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = torch.topk(row, n).indices.tolist()
        assert set(entry) == {tok, *top}
        for k, t in enumerate(top):
            assert entry[t].rank == k + 1 or t == tok


def test_prompt_logprobs_are_the_log_softmax_of_the_prefill_logits(llm):
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=N)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    ref = prefill_logprobs(llm, out.prompt_token_ids)
    assert_matches(out, ref)
    # perplexity through the public API
    ids = out.prompt_token_ids
    nll = -sum(e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True))
    ref_nll = -sum(float(ref[j - 1, t]) for j, t in enumerate(ids) if j)
    assert math.exp(nll / (len(ids) - 1)) == pytest.approx(math.exp(ref_nll / (len(ids) - 1)))


@pytest.mark.parametrize("budget", [5, 13])
def test_chunked_prefill_and_batch_composition_give_the_same_prompt_logprobs(budget):
    llm = tiny_llm(max_num_batched_tokens=budget)
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=N)
    plain = SamplingParams(temperature=0, max_tokens=2)
    outs = llm.generate([OTHERS[0], PROMPT, OTHERS[1]], [plain, asked, asked], use_tqdm=False)
    assert outs[0].prompt_logprobs is None
    for o in outs[1:]:
        assert_matches(o, prefill_logprobs(llm, o.prompt_token_ids))


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_prompt_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=bad)
