"""The driver <-> rank messages survive the wire exactly and refuse anything else."""

from __future__ import annotations

import math

import pytest
from deepinfer_engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer_engine.step_messages import (
    Abort,
    Generate,
    MessageError,
    RankDone,
    RankOutputs,
    RankRequest,
    RankTimes,
    decode,
    encode,
)
from deepinfer_parallel.dp_balance import RankLoad
from deepinfer_sampling.params import SamplingParams
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, (1 << 63) - 1),
    st.dictionaries(st.integers(0, 4000), st.floats(-100, 100), max_size=3),
    st.lists(st.text(min_size=1, max_size=4), max_size=2),
    st.floats(0, 2),
    st.one_of(st.none(), st.integers(0, 20)),
)
def test_requests_round_trip(seed, bias, stop, temperature, logprobs):
    params = SamplingParams(
        temperature=temperature,
        seq_seed=seed,
        logit_bias=bias or None,
        stop=stop,
        logprobs=logprobs,
        so_args={"schema_type": "regex", "schema": "[ab]+"},
    )
    msg = Generate([RankRequest("7", "hi", [1, 2, 3], params)])
    assert decode(encode(msg)) == msg


def test_outputs_keep_every_float_and_int_key():
    step = {5: Logprob(-math.inf, 2), 9: Logprob(-0.125, 1, "x")}
    out = RequestOutput(
        "3",
        None,
        [4, 5],
        [CompletionOutput(0, "ab", [9], -0.1, [step], "stop", 1, None)],
        True,
        prompt_logprobs=[None, step],
    )
    got = decode(encode(RankOutputs([out])))
    assert (
        got == RankOutputs([out]) and got.outputs[0].outputs[0].logprobs[0][5].logprob == -math.inf
    )
    done = RankDone(2, RankLoad(10, 64), RankTimes(3, 0.5, 0.01, 0.2, 1))
    assert decode(encode(done)) == done
    assert decode(encode(Abort("ctrl-c"))) == Abort("ctrl-c")


@pytest.mark.parametrize(
    "raw",
    [b"not json", b'{"kind": "Exec", "body": {}}', b'{"kind": "RankDone", "body": {"rank": 1}}'],
)
def test_foreign_or_malformed_messages_are_refused(raw):
    with pytest.raises(MessageError):
        decode(raw)
