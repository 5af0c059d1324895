"""The typed messages between an LLM's driver process and its rank processes, and their codec.

Driver -> rank: `Generate` (the requests of this rank's DP rank for one `generate` call),
`Abort` (stop the run in progress), `Shutdown`. Rank -> driver: `RankReady` (loaded: what it
holds and what it can take), `RankOutputs` (requests that finished in a step; DP leaders only),
`RankDone` (the run ended on every rank; its load and timings).

On the wire a message is UTF-8 JSON ``{"kind": <class name>, "body": {...}}``. `decode` builds
only the message classes listed here, field by field, and `SamplingParams` re-validates what it
receives: nothing is unpickled, so a malformed or foreign message is an error, never code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from deepinfer_parallel.dp_balance import RankLoad
from deepinfer_sampling.params import SamplingParams

from deepinfer_engine.outputs import CompletionOutput, Logprob, RequestOutput


class MessageError(ValueError):
    """A message that is not one of this module's, or does not have its fields."""


@dataclass(frozen=True)
class RankRequest:
    """One request as a rank receives it: the driver's `request_id`, the validated prompt and
    its sampling parameters."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Generate:
    requests: list[RankRequest]


@dataclass(frozen=True)
class Abort:
    reason: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class RankReady:
    """A rank has loaded its part: `max_model_len` it accepts (its KV plan), the bytes it read
    from the checkpoint and its peak resident memory after loading."""

    rank: int
    max_model_len: int
    loaded_bytes: int
    peak_rss_bytes: int


@dataclass(frozen=True)
class RankOutputs:
    outputs: list[RequestOutput]


@dataclass(frozen=True)
class RankTimes:
    """Wall seconds of a run on one rank: all engine steps (`steps_s`), of which in the step
    agreement (`sync_s`) and in the MoE / Engram collectives (`comm_s`); steps run; rebalances."""

    steps: int = 0
    steps_s: float = 0.0
    sync_s: float = 0.0
    comm_s: float = 0.0
    rebalances: int = 0


@dataclass(frozen=True)
class RankDone:
    rank: int
    load: RankLoad
    times: RankTimes = field(default_factory=RankTimes)


Message = Generate | Abort | Shutdown | RankReady | RankOutputs | RankDone


def _plain(value: Any) -> Any:
    """Dataclasses, tuples and dicts as JSON values (dict keys as strings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def encode(msg: Message) -> bytes:
    return json.dumps({"kind": type(msg).__name__, "body": _plain(msg)}).encode()


def _positions(steps: list | None) -> list[dict[int, Logprob] | None] | None:
    """Per-position {token id: Logprob} dicts back from JSON (string keys; None entries kept)."""
    if steps is None:
        return None
    return [
        None if step is None else {int(t): Logprob(**lp) for t, lp in step.items()}
        for step in steps
    ]


def _output(body: dict) -> RequestOutput:
    outs = [
        CompletionOutput(**{**c, "logprobs": _positions(c["logprobs"])}) for c in body["outputs"]
    ]
    prompt = _positions(body.get("prompt_logprobs"))
    return RequestOutput(**{**body, "outputs": outs, "prompt_logprobs": prompt})


def _request(body: dict) -> RankRequest:
    return RankRequest(
        request_id=str(body["request_id"]),
        prompt=body["prompt"],
        prompt_token_ids=[int(t) for t in body["prompt_token_ids"]],
        params=SamplingParams(**body["params"]),
    )


def decode(data: bytes) -> Message:
    try:
        obj = json.loads(data)
        kind, body = obj["kind"], obj["body"]
        if kind == "Generate":
            return Generate([_request(r) for r in body["requests"]])
        if kind == "Abort":
            return Abort(str(body["reason"]))
        if kind == "Shutdown":
            return Shutdown()
        if kind == "RankReady":
            return RankReady(**body)
        if kind == "RankOutputs":
            return RankOutputs([_output(o) for o in body["outputs"]])
        if kind == "RankDone":
            return RankDone(body["rank"], RankLoad(**body["load"]), RankTimes(**body["times"]))
    except (ValueError, KeyError, TypeError) as e:
        raise MessageError(f"malformed step message: {type(e).__name__}: {e}") from None
    raise MessageError(f"unknown step message kind {kind!r}")
