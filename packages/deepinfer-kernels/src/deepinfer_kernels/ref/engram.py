"""Engram gating, in torch (the `ref` tier)."""

from __future__ import annotations

import torch


def engram_gate(
    h: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    clamp: float = 1e-6,
) -> torch.Tensor:
    """Add the gated Engram value to every residual stream.

    h: [T, hc, D]; key: [T, hc, D]; value: [T, D]; weight: [hc, D] (q_weight * k_weight).
    ``dot = sum_d(h * weight * key) * rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps) / sqrt(D)``
    (normalised per token and stream), ``g = sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))``,
    ``h + g * value``. fp32 math; returns h.dtype.
    """
    d = h.shape[-1]
    hf, kf = h.float(), key.float()
    rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(kf.square().mean(-1) + eps)
    dot = (hf * weight.float() * kf).sum(-1) * rstd * d**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(clamp).sqrt(), dot))
    return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(h.dtype)
