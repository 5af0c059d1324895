"""Structured output through the sampler package, over the toy model (async on and off)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from deepinfer_sampling.params import SamplingParams
from test_engine_toy import PROMPTS, greedy_reference, make

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}, "b": {"enum": ["xy", "abc", "q"]}},
    "required": ["a", "b"],
}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_regex_and_json_schema_parse(async_scheduling):
    llm = make(async_scheduling=async_scheduling, max_model_len=256)
    regex = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=30,
        so_args={"schema_type": "regex", "schema": "[a-c]{3}x[0-9]+"},
    )
    js = SamplingParams(
        temperature=1.0, seed=5, max_tokens=200, so_args={"schema_type": "json", "schema": SCHEMA}
    )
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [regex, js, js], use_tqdm=False)
    r = outs[0].outputs[0]
    assert r.finish_reason == "stop" and re.fullmatch("[a-c]{3}x[0-9]+", r.text), r
    for o in outs[1:]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_grammar_dead_end_ends_only_that_request():
    # The toy vocabulary has no "z": after "a" the grammar allows no token at all.
    llm = make()
    dead = SamplingParams(
        temperature=0, max_tokens=10, so_args={"schema_type": "regex", "schema": "az"}
    )
    ok = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [ok, dead], use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "dead end" in outs[1].outputs[0].error
    assert outs[1].outputs[0].token_ids == [2]  # "a"
    assert outs[0].outputs[0].token_ids == greedy_reference(PROMPTS[0], 6)


def test_invalid_schema_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="so_args"):
        SamplingParams(so_args={"schema_type": "regex", "schema": "(unclosed"})


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_grammar_end_blocked_by_min_tokens_is_a_dead_end_not_a_garbage_token(async_scheduling):
    # After 5 letters the regex allows only its end (EOS), which min_tokens=8 masks: no token
    # is allowed. That request ends with a dead-end error, and no token outside the grammar
    # (whatever the sampler drew from an all -inf row) reaches its output.
    llm = make(async_scheduling=async_scheduling)
    blocked = SamplingParams(
        temperature=0,
        min_tokens=8,
        max_tokens=10,
        so_args={"schema_type": "regex", "schema": "[a-c]{2,5}"},
    )
    ok = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [ok, blocked], use_tqdm=False)
    c = outs[1].outputs[0]
    assert c.finish_reason == "error" and "dead end" in c.error, c
    assert re.fullmatch("[a-c]{5}", c.text) and len(c.token_ids) == 5, c
    assert outs[0].outputs[0].token_ids == greedy_reference(PROMPTS[0], 6)
