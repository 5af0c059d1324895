"""The Triton MoE expert kernels under the Triton interpreter on CPU against float64 loops:
`interp_moe_checks.py` in a subprocess (Triton reads TRITON_INTERPRET when it is imported). On a
GPU machine test_gpu.py runs them compiled."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernels instead")
def test_interpreted_moe_kernels():
    script = pathlib.Path(__file__).with_name("interp_moe_checks.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "interpreted moe checks passed" in done.stdout
