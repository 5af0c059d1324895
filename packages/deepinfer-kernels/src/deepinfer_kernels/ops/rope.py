"""Rotary position embedding: `rope` (interleaved adjacent pairs).

Tiers: `triton` (the default on a GPU and the portable one: one launch per call on any CUDA GPU
Triton supports), `ref` (torch: the numerics oracle and the CPU path)."""

from __future__ import annotations

import torch

from ..registry import REGISTRY, Implementation

REGISTRY.declare(
    "rope",
    "x [T, ..., rd], positions [T], inv_freq [rd/2] fp32, inverse -> [T, ..., rd] x.dtype",
)
REGISTRY.register(Implementation("rope", "ref", "deepinfer_kernels.ref.rope:rope"))
REGISTRY.register(
    Implementation(
        "rope",
        "triton",
        "deepinfer_kernels.triton.rope:rope",
        devices=("cuda",),
        min_capability=(9, 0),
        requires=("triton",),
        supports="deepinfer_kernels.ops._checks:cuda_input_reason",
    )
)


def rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by angle positions[t] * inv_freq[i] (negated if `inverse`).

    x: [T, ..., rd]; positions: [T]; inv_freq: [rd/2] fp32. Returns a new tensor like x.
    """
    return REGISTRY.call("rope", x, positions, inv_freq, inverse)
