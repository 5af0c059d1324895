"""SamplingParams fields named and behaving as vLLM's: detokenization flags and
`structured_outputs` (vLLM's spelling of structured output, beside `so_args`)."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from deepinfer_sampling.params import (
    SamplingParams,
    StructuredOutput,
    StructuredOutputsParams,
)
from hypothesis import given, settings
from hypothesis import strategies as st

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_detokenization_flags_default_as_vllm_and_must_be_bools():
    sp = SamplingParams()
    assert sp.skip_special_tokens is True and sp.spaces_between_special_tokens is True
    assert SamplingParams(skip_special_tokens=False).skip_special_tokens is False
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be a bool"):
            SamplingParams(**{name: "no"})


@pytest.mark.parametrize(
    ("given_", "want"),
    [
        ({"json": SCHEMA}, StructuredOutput.normalise({"schema_type": "json", "schema": SCHEMA})),
        ({"json": '{"type": "integer"}'}, StructuredOutput("json_schema", '{"type":"integer"}')),
        ({"regex": "[a-c]{3}"}, StructuredOutput("regex", "[a-c]{3}")),
        ({"grammar": 'root ::= "x" | "y"'}, StructuredOutput("ebnf", 'root ::= "x" | "y"')),
        ({"choice": ["yes", "no"]}, StructuredOutput("ebnf", 'root ::= "yes" | "no"')),
    ],
)
def test_structured_outputs_map_onto_the_structured_output_machinery(given_, want):
    for form in (given_, StructuredOutputsParams(**given_)):
        sp = SamplingParams(structured_outputs=form)
        assert sp.structured_output == want
        assert sp.so_args is None
        assert isinstance(sp.structured_outputs, StructuredOutputsParams)
        assert sp.replace() == sp  # revalidates without mistaking the mapping for so_args
    assert SamplingParams(so_args=want).structured_output == want
    assert SamplingParams().structured_output is None


def test_so_args_and_structured_outputs_are_one_at_a_time():
    with pytest.raises(ValueError, match="so_args and structured_outputs"):
        SamplingParams(
            so_args={"schema_type": "regex", "schema": "a"}, structured_outputs={"regex": "a"}
        )


@pytest.mark.parametrize(
    ("form", "error", "match"),
    [
        ({}, ValueError, "exactly one of json, regex, choice, grammar"),
        ({"regex": "a", "choice": ["a"]}, ValueError, "exactly one of .* got choice, regex"),
        ({"regexp": "a"}, ValueError, r"unknown keys \['regexp'\]"),
        ({"choice": []}, ValueError, "choice must be a non-empty list"),
        ({"choice": ["a", ""]}, ValueError, "choice must be a non-empty list"),
        ({"choice": "ab"}, ValueError, "choice must be a non-empty list"),
        ({"regex": "(unclosed"}, ValueError, "structured_outputs.regex is not a valid regex"),
        ({"json": "{not json"}, ValueError, "structured_outputs.json is not valid JSON"),
        ({"json_object": True}, NotImplementedError, "json_object"),
        ({"structural_tag": "{}"}, NotImplementedError, "structural_tag"),
        ({"regex": "a", "disable_any_whitespace": True}, NotImplementedError, "whitespace"),
        ({"regex": "a", "whitespace_pattern": " "}, NotImplementedError, "whitespace_pattern"),
    ],
)
def test_bad_structured_outputs_are_named(form, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(structured_outputs=form)


@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_choice_grammar_accepts_exactly_the_choices(choices):
    so = SamplingParams(structured_outputs={"choice": choices}).structured_output
    grammar = xgr.Grammar.from_ebnf(so.schema)
    # every choice is a sentence of the grammar, and the grammar's alternatives are the choices
    for c in choices:
        assert xgr.testing._is_grammar_accept_string(grammar, c), (so.schema, c)
    assert not xgr.testing._is_grammar_accept_string(grammar, "".join(choices) + "\x00")
