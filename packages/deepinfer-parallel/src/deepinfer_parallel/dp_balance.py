"""Attention-DP load balancing: which DP rank takes each new request.

Round-robin ignores that prompts differ by orders of magnitude in length and that ranks start a
batch with different amounts of work. Here each request goes, in arrival order, to the DP rank
with the least load, where load is the tokens it still has to prefill (waiting tokens) plus the
tokens its KV cache holds (KV use), and the request's own cost (`n` sequences x prompt length)
is added to that rank's waiting tokens. This greedy list scheduling keeps the final spread of
loads within the largest single request's cost.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankLoad:
    """One DP rank's load: tokens still to prefill, tokens held in its KV cache."""

    waiting_tokens: int = 0
    kv_tokens: int = 0

    @property
    def total(self) -> int:
        return self.waiting_tokens + self.kv_tokens


def assign_requests(costs: Sequence[int], loads: Sequence[RankLoad]) -> list[int]:
    """The DP rank of each request: costs[i] >= 0 are the requests' waiting tokens in arrival
    order, loads[r] the ranks' current loads. Ties go to the lower rank (deterministic: every
    rank that runs this on the same input gets the same answer)."""
    if not loads:
        raise ValueError("assign_requests: needs at least one DP rank")
    if any(c < 0 for c in costs):
        raise ValueError(f"assign_requests: costs must be >= 0, got {list(costs)}")
    heap = [(load.total, r) for r, load in enumerate(loads)]
    heapq.heapify(heap)
    out = []
    for c in costs:
        total, r = heapq.heappop(heap)
        out.append(r)
        heapq.heappush(heap, (total + c, r))
    return out
