"""The progress of `generate`: tqdm's bar on a terminal; elsewhere (logs, pipes, CI) one plain
line per interval instead of a flood of carriage-return updates."""

from __future__ import annotations

import io
import sys

from deepinfer_engine.progress import LineProgress
from deepinfer_sampling.params import SamplingParams
from test_engine_toy import PROMPTS, make


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_interval_and_a_last_line():
    out, clock = io.StringIO(), Clock()
    bar = LineProgress(30, "Processed prompts", out, interval=10.0, clock=clock)
    for i in range(30):
        clock.now = float(i)
        bar.update(1)
        bar.set_postfix_str(f"{i}.0 tok/s")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and out.getvalue().endswith("\n")
    assert len(lines) == 3  # at 10 s, at 20 s, and the last
    assert lines[0] == "Processed prompts: 11/30 (37%), 9.0 tok/s, 10 s"
    assert lines[-1] == "Processed prompts: 30/30 (100%), 29.0 tok/s, 29 s"


def test_generate_writes_plain_lines_when_stderr_is_not_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    make().generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=True)
    text = err.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 1, text  # the toy finishes within one interval: the last line only
    assert lines[0].startswith(f"Processed prompts: {len(PROMPTS)}/{len(PROMPTS)} (100%)")
