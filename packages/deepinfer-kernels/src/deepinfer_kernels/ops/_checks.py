"""Argument checks shared by the op modules: a bad argument is a ValueError that
names the parameter and what was expected."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def need(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def need_dtype(t: torch.Tensor, name: str, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:  # the message is built only for a failure (hot path)
        raise ValueError(
            f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}"
        )


def cuda_input_reason(x: torch.Tensor, *args: object, **kwargs: object) -> str | None:
    """The `supports` check the GPU tiers share: why they cannot run a call whose first tensor
    is `x` (it is not on CUDA), or None."""
    if x.device.type != "cuda":
        return f"input on {x.device.type}"
    return None
