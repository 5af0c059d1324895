"""Normalisation ops: `rms_norm`."""

from __future__ import annotations

import torch

from ..registry import REGISTRY, Implementation

REGISTRY.declare("rms_norm", "x [..., d], weight [d], eps -> [..., d] x.dtype (fp32 statistics)")
REGISTRY.register(Implementation("rms_norm", "ref", "deepinfer_kernels.ref.norm:rms_norm"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x * rsqrt(mean(x^2) + eps)`` over the last dim; x [..., d] -> [..., d]."""
    return REGISTRY.call("rms_norm", x, weight, eps)
