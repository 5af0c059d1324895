"""SamplingParams validation: each bad value raises a ValueError naming its field."""

import dataclasses

import pytest
from deepinfer_sampling import SamplingParams, StructuredOutput
from hypothesis import given, settings
from hypothesis import strategies as st

BAD_VALUES = {
    "n": [0, -1, 1.5, True, "2"],
    "temperature": [-0.1, float("nan"), float("inf"), "1"],
    "top_p": [0.0, -0.5, 1.01, float("nan")],
    "top_k": [-2, 1.0, None],
    "min_p": [-0.01, 1.5],
    "presence_penalty": [-2.5, 2.01],
    "frequency_penalty": [3.0, float("-inf")],
    "repetition_penalty": [0.0, -1.0, 2.5],
    "max_tokens": [0, -3, 2.0],
    "min_tokens": [-1, 0.5],
    "stop": [3, [""], ["a", 1]],
    "stop_token_ids": [[-1], "3", [1.0]],
    "ignore_eos": [1, "yes"],
    "logprobs": [-1, 2000, 1.5],
    "logit_bias": [[1, 2], {-1: 1.0}, {3: 101.0}, {3: float("nan")}],
    "seq_seed": [-1, 2**63, 1.0],
    "seed": [-5, "x"],
    "so_args": ["json", {"schema_type": "yaml", "schema": "a"}, {"schema": "{}"}],
}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_bad_value_names_field(data):
    field = data.draw(st.sampled_from(sorted(BAD_VALUES)))
    value = data.draw(st.sampled_from(BAD_VALUES[field]))
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    name = "logit_bias" if field == "logit_bias" else field
    assert name in str(info.value)


@settings(max_examples=40, deadline=None)
@given(
    temperature=st.floats(0, 5),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(-1, 1000),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(0, 2**63 - 1),
)
def test_valid_values_accepted(temperature, top_p, top_k, min_p, seed):
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    assert p.seq_seed == seed and p.seed == seed
    assert p.is_greedy == (temperature == 0.0)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_seed_alias():
    assert SamplingParams(seed=3).seq_seed == 3
    assert SamplingParams(seq_seed=4).seed == 4
    assert SamplingParams(seed=5, seq_seed=5).seq_seed == 5
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=5, seq_seed=6)


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5, 6], logit_bias={"7": 1.5})
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6) and p.logit_bias == {7: 1.5}
    # replace() validates again.
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_p = 0.5  # type: ignore[misc]


def test_so_args_normalisation():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_dict = SamplingParams(so_args={"schema_type": "json", "schema": schema}).so_args
    as_text = SamplingParams(
        so_args={
            "schema_type": "json_schema",
            "schema": ' {"type": "object", "properties": '
            '{"b": {"type": "integer"}, "a": {"type": "string"}}}',
        }
    ).so_args
    assert isinstance(as_dict, StructuredOutput) and as_dict == as_text
    assert as_dict.schema_type == "json_schema"
    assert as_dict.schema.index('"b"') < as_dict.schema.index('"a"')  # declared order kept
    regex = SamplingParams(so_args={"schema_type": "regex", "schema": "[a-c]{2,4}"}).so_args
    assert regex == StructuredOutput("regex", "[a-c]{2,4}")
    assert SamplingParams(so_args=regex).so_args is regex


@pytest.mark.parametrize(
    "so_args",
    [
        {"schema_type": "json", "schema": "{not json"},
        {"schema_type": "json", "schema": {"type": "no-such-type"}},
        {"schema_type": "json", "schema": 3},
        {"schema_type": "regex", "schema": "a(b"},
        {"schema_type": "regex", "schema": ""},
        {"schema_type": "ebnf", "schema": "root ::= undefined_rule"},
        {"schema_type": "ebnf", "schema": 'root ::= "a" |'},
    ],
)
def test_invalid_schema_fails_at_construction(so_args):
    with pytest.raises(ValueError, match="so_args"):
        SamplingParams(so_args=so_args)
