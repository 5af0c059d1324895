"""The examples' command lines: a flag this machine cannot honour is a clean usage error that
names the argument, not a traceback naming an environment variable."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_accelerator_flag_without_cuda_names_the_argument(capsys, monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    with pytest.raises(SystemExit) as exit_:
        load("offline_inference").main(["--accelerator", "nvidia"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "accelerator='nvidia' (the accelerator argument)" in err
    assert "CUDA is not available" in err and "DEEPINFER_ACCELERATOR" not in err
