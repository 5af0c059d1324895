"""Normalisation ops: `rms_norm`.

Tiers: `triton` (the default on a GPU and the portable one: one launch per call on any CUDA GPU
Triton supports), `ref` (torch: the numerics oracle and the CPU path)."""

from __future__ import annotations

import torch

from ..registry import REGISTRY, Implementation

REGISTRY.declare("rms_norm", "x [..., d], weight [d], eps -> [..., d] x.dtype (fp32 statistics)")
REGISTRY.register(Implementation("rms_norm", "ref", "deepinfer_kernels.ref.norm:rms_norm"))
REGISTRY.register(
    Implementation(
        "rms_norm",
        "triton",
        "deepinfer_kernels.triton.norm:rms_norm",
        devices=("cuda",),
        min_capability=(9, 0),
        requires=("triton",),
        supports="deepinfer_kernels.ops._checks:cuda_input_reason",
    )
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x * rsqrt(mean(x^2) + eps)`` over the last dim; x [..., d] -> [..., d]."""
    return REGISTRY.call("rms_norm", x, weight, eps)
