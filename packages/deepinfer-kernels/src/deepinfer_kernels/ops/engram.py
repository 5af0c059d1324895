"""Engram op: `engram_gate` (gated n-gram memory added to every residual stream).

Tiers: `ref` only (torch, on the GPU too) so far."""

from __future__ import annotations

import torch

from ..registry import REGISTRY, Implementation

REGISTRY.declare(
    "engram_gate", "h [T,hc,D], key [T,hc,D], value [T,D], weight [hc,D], eps -> [T,hc,D]"
)
REGISTRY.register(Implementation("engram_gate", "ref", "deepinfer_kernels.ref.engram:engram_gate"))


def engram_gate(
    h: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``h + sigmoid(signed_sqrt(normalised <h, weight*key>)) * value`` per stream.

    See `deepinfer_kernels.ref.engram.engram_gate` for the exact formula."""
    return REGISTRY.call("engram_gate", h, key, value, weight, eps)
