"""vLLM's SamplingParams fields through the engine, over the toy model: detokenization flags,
`structured_outputs`, logprobs' decoded tokens, logprob counts checked against the vocabulary."""

from __future__ import annotations

import re

import pytest
from deepinfer_engine.detokenizer import IncrementalDetokenizer
from deepinfer_sampling.params import SamplingParams, StructuredOutputsParams
from test_engine_toy import PROMPTS, make
from toy import VOCAB, ToyTokenizer

BOS = VOCAB.index("<bos>")


@pytest.mark.parametrize(
    ("skip", "spaces", "text"),
    [(True, True, "ab"), (False, False, "<bos>a<bos>b"), (False, True, " <bos> a <bos> b")],
)
def test_special_tokens_in_the_text_follow_the_detokenization_flags(skip, spaces, text):
    # the output continues the prompt's text: a special token first in it stands apart from
    # the prompt's last token too
    d = IncrementalDetokenizer(
        ToyTokenizer(),
        [VOCAB.index("c")],
        skip_special_tokens=skip,
        spaces_between_special_tokens=spaces,
    )
    for t in (BOS, VOCAB.index("a"), BOS, VOCAB.index("b")):
        d.add_token(t)
    d.flush()
    assert d.text == text


def test_engine_passes_the_detokenization_flags_on():
    llm = make()
    bos = {BOS: 100.0}
    shown = SamplingParams(temperature=0, max_tokens=3, logit_bias=bos, skip_special_tokens=False)
    joined = shown.replace(spaces_between_special_tokens=False)
    hidden = shown.replace(skip_special_tokens=True)
    outs = llm.generate([PROMPTS[0]] * 3, [shown, joined, hidden], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[BOS] * 3] * 3
    assert [o.outputs[0].text for o in outs] == [" <bos> <bos> <bos>", "<bos><bos><bos>", ""]


def test_logprobs_carry_their_decoded_tokens():
    llm = make()
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=5, logprobs=3))
    c = out[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for lps in c.logprobs:
        assert len(lps) >= 3
        for tid, lp in lps.items():
            assert lp.decoded_token == VOCAB[tid]


def test_logprobs_above_the_vocabulary_are_refused():
    llm = make()
    n = len(VOCAB)
    ok = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=n))
    assert len(ok[0].outputs[0].logprobs[0]) == n
    for field in ("logprobs",):
        bad = SamplingParams(temperature=0, max_tokens=1, **{field: n + 1})
        with pytest.raises(ValueError, match=rf"prompt 1: {field}={n + 1} .* vocabulary of {n}"):
            llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(), bad], use_tqdm=False)


def test_structured_outputs_constrain_generation_as_so_args():
    llm = make(max_model_len=256)
    regex = "[a-c]{3}x[0-9]+"
    so = SamplingParams(
        temperature=1.0, seed=3, max_tokens=30, so_args={"schema": regex, "schema_type": "regex"}
    )
    vllm = so.replace(so_args=None, structured_outputs=StructuredOutputsParams(regex=regex))
    choice = SamplingParams(
        temperature=1.0,
        seed=4,
        max_tokens=30,
        structured_outputs={"choice": ["yes", "no", "maybe"]},
    )
    a, b, c = llm.generate([PROMPTS[0]] * 3, [so, vllm, choice], use_tqdm=False)
    assert (
        re.fullmatch(regex, a.outputs[0].text) and a.outputs[0].token_ids == b.outputs[0].token_ids
    )
    assert c.outputs[0].text in ("yes", "no", "maybe") and c.outputs[0].finish_reason == "stop"
