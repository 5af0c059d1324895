"""What `LLM.generate` returns, with vLLM's field names so existing user code keeps working."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability: natural log of the model's raw distribution (before
    temperature, penalties, bias and filters; vLLM's default `raw_logprobs`).

    `rank` is 1 for the most likely token; None when the sampler did not report it.
    `decoded_token`: the token's text decoded alone (special tokens spelled out).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_entry(
    token_id: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]
) -> dict[int, Logprob]:
    """One position's {token_id: Logprob}: the given token, then the top ones in order (rank
    k+1 for the k-th; the given token keeps its own rank when it is among them)."""
    entry = {token_id: Logprob(logprob, rank=rank)}
    for k, (t, lp) in enumerate(zip(top_ids, top_logprobs, strict=True)):
        entry.setdefault(t, Logprob(lp, rank=k + 1))
    return entry


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    finish_reason: "stop" (EOS, a stop string/id, or the grammar ended), "length" (`max_tokens`
    or `max_model_len`), "error" (a mid-run failure of this request alone; see `error`), or None
    while unfinished. stop_reason: the stop string or stop token id that ended it, else None.
    logprobs: per generated token, {token_id: Logprob} (sampled token + top-N) when requested.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt: its `n` completions, in index order.

    prompt_logprobs: with `SamplingParams.prompt_logprobs`, one entry per prompt token: None
    for the first, then {token_id: Logprob} with the token's logprob given the tokens before it
    and the top N there (vLLM's field); None when not asked.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
