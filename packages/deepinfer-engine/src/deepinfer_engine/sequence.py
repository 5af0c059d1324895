"""A sequence: one of the `n` completions of a request, and all the host state it carries.

Token accounting (the invariant the scheduler keeps):
    num_tokens = len(prompt_token_ids) + len(output_token_ids) + num_inflight
    0 <= num_computed_tokens <= num_tokens
`num_inflight` counts tokens sampled on the device whose ids the host does not know yet (async
scheduling's placeholders). `num_computed_tokens` counts tokens whose KV is written (or queued to
be written by an already-launched step) into this sequence's slot and pages.

Prompt logprobs (vLLM's `prompt_logprobs`, the request's first completion only): the logits row
of prompt position j gives the logprob of prompt token j+1. `num_prompt_logits` counts the
positions 0.. whose rows a launched step asked for; a recompute after preemption asks only for
the rows beyond it, so no entry is computed twice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from deepinfer_engine.detokenizer import IncrementalDetokenizer
from deepinfer_engine.outputs import Logprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Host state of one completion. `params` is a `deepinfer_sampling.SamplingParams`."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: Any
    detokenizer: IncrementalDetokenizer | None = None
    seed: int | None = None  # per-completion seed (request seed + index), None = unseeded
    grammar: Any = None  # the sampler's per-request grammar matcher, or None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    num_preemptions: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_prompt_logits: int = 0

    def __post_init__(self) -> None:
        if self.wants_prompt_logprobs:
            self.prompt_logprobs = [None]  # the first token has no context

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Computes the request's prompt logprobs: asked for, and its first completion."""
        return self.index == 0 and getattr(self.params, "prompt_logprobs", None) is not None

    def prompt_logit_positions(self, start: int, end: int) -> tuple[int, int] | None:
        """Of the positions [start, end) a step computes, the ones [a, b) whose logits give
        prompt logprobs still missing (None: none); marks them asked for."""
        if not self.wants_prompt_logprobs:
            return None
        a, b = max(start, self.num_prompt_logits), min(end, self.num_prompt_tokens - 1)
        if a >= b:
            return None
        self.num_prompt_logits = b
        return a, b

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end); in-flight positions are -1."""
        if end > max(start, self.num_tokens):
            raise IndexError(
                f"position {max(start, self.num_tokens)} >= num_tokens {self.num_tokens}"
            )
        p = len(self.prompt_token_ids)
        ids = (
            self.prompt_token_ids[start:end]
            + self.output_token_ids[max(start - p, 0) : max(end - p, 0)]
        )
        return ids + [-1] * (end - start - len(ids))

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""
