"""Wall time spent in collectives, for benchmarks (`tools/bench_parallel.py`).

On gloo a collective returns when it is done, so the wall time around it is its cost. On NCCL
it returns once enqueued: the figure is then the host's launch cost only, and the device-side
cost is measured against a single-rank run instead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class CommStats:
    """Accumulated `seconds` and `calls` of the collectives timed with `timed`."""

    seconds: float = 0.0
    calls: int = 0

    @contextmanager
    def timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0
