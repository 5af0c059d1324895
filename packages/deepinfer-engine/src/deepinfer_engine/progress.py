"""The progress of one `generate` call on stderr (`progress_bar`).

On a terminal it is tqdm's bar, redrawn in place. Anywhere else (a log file, a pipe, CI) a bar
redraws with carriage returns, which a log keeps as one update after another; there it is one
plain line per `LOG_INTERVAL_S` seconds instead, and a last line when the call ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Protocol, TextIO

LOG_INTERVAL_S = 10.0
"""Seconds between two progress lines when stderr is not a terminal."""


class Progress(Protocol):
    """What `LLM.generate` drives: tqdm's bar, or `LineProgress`."""

    def update(self, n: int = 1) -> object: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def close(self) -> None: ...


class LineProgress:
    """`desc: done/total (pct%), postfix, elapsed` as one line on `file`, at most once per
    `interval` seconds of `clock`, and once more at `close`."""

    def __init__(
        self,
        total: int,
        desc: str,
        file: TextIO,
        interval: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.desc, self.file = total, desc, file
        self.interval, self.clock = interval, clock
        self.done = 0
        self.postfix = ""
        self.start = clock()
        self.last = self.start
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.done += n
        self._maybe_write()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s
        if refresh:
            self._maybe_write()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._write(self.clock())

    def _maybe_write(self) -> None:
        now = self.clock()
        if now - self.last >= self.interval:
            self._write(now)

    def _write(self, now: float) -> None:
        self.last = now
        parts = [f"{self.done}/{self.total} ({100 * self.done / max(self.total, 1):.0f}%)"]
        if self.postfix:
            parts.append(self.postfix)
        parts.append(f"{now - self.start:.0f} s")
        self.file.write(f"{self.desc}: {', '.join(parts)}\n")
        self.file.flush()


def progress_bar(total: int, desc: str) -> Progress:
    """tqdm's bar when stderr is a terminal, else a `LineProgress` on stderr."""
    err = sys.stderr
    isatty = getattr(err, "isatty", None)
    if isatty is not None and isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, dynamic_ncols=True)
    return LineProgress(total, desc, err)
