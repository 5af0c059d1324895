"""Argument checks shared by the kernels helper's op modules: a bad argument is a ValueError that
names the parameter and what was expected."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def need(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def need_dtype(t: torch.Tensor, name: str, *dtypes: torch.dtype) -> None:
    need(
        t.dtype in dtypes,
        f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}",
    )


def gpu_reason(t: torch.Tensor, min_rows: int = 0) -> str | None:
    """Common `supports` check of the GPU tiers: a CUDA tensor in a float dtype."""
    if t.device.type != "cuda":
        return f"input on {t.device.type}"
    if t.dtype not in FLOAT_DTYPES:
        return f"dtype {t.dtype} not in {FLOAT_DTYPES}"
    return None
