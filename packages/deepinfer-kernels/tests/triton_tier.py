"""Set-up shared by the CPU tests of the triton tiers (imported first by those test modules).

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU, which must be set before triton is
imported and before a kernel module defines its kernels; with CUDA they run compiled. A module
without triton installed is skipped with the reason.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="the triton tier needs triton installed")


def triton_module(name: str):
    """deepinfer_kernels.triton.<name>, (re)imported so its kernels honour TRITON_INTERPRET."""
    mod = importlib.import_module(f"deepinfer_kernels.triton.{name}")
    interpreted = any(
        type(v).__name__ == "InterpretedFunction" for v in vars(mod).values() if callable(v)
    )
    if DEV == "cpu" and not interpreted:
        mod = importlib.reload(mod)
    return mod
