"""build.sh: an accelerator whose engine path does not exist yet is refused plainly, before
anything is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_build(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    # a `uv` that records being called stands in for the real one: nothing is installed
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "uv").write_text(f'#!/usr/bin/env bash\necho "$@" >> {tmp_path / "uv.log"}\n')
    (fake / "uv").chmod(0o755)
    path = f"{fake}:{os.environ['PATH']}"
    return subprocess.run(
        ["bash", str(ROOT / "build.sh")],
        env={**os.environ, "PATH": path, **env},
        capture_output=True,
        text=True,
        check=False,
    )


def test_ascend_says_the_npu_path_is_not_available_yet(tmp_path):
    out = run_build(tmp_path, DEEPINFER_ACCELERATOR="ascend")
    assert out.returncode == 2
    assert "NPU path is not available yet" in out.stderr
    assert not (tmp_path / "uv.log").exists()


def test_cpu_installs_without_extras(tmp_path):
    out = run_build(tmp_path, DEEPINFER_ACCELERATOR="cpu")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "uv.log").read_text().split() == ["sync"]
