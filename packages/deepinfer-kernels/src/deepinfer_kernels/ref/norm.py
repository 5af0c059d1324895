"""RMSNorm in torch (the `ref` tier)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., d], weight: [d] -> [..., d] in x.dtype; statistics in fp32.

    ``y = weight * x * rsqrt(mean(x^2) + eps)``. V4.1 uses eps = 1e-20, so an all-zero row stays
    zero only because 0 * rsqrt(1e-20) = 0; no clamp is applied.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)
