"""Reference activation quantisation: plain, fused with RMSNorm, fused with clamped SwiGLU.

Each fused op computes exactly what the unfused chain computes in the reference model: the
intermediate is rounded to the activation dtype (what the reference holds between the ops), then
quantised to FP8 e4m3 per 32 channels with power-of-two scales (`quant.act_quant_fp8`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import quant
from .norm import rms_norm


def act_quant_fp8(x: torch.Tensor, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_fp8 [..., K] e4m3, scale [..., K/32] fp32 powers of two)."""
    return quant.act_quant_fp8(x)


def rms_norm_act_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm then per-32 FP8 quantisation: x [..., K], weight [K] -> (x_fp8, scale)."""
    return quant.act_quant_fp8(rms_norm(x, weight, eps))


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    route_weight: torch.Tensor | None,
    swiglu_limit: float,
) -> torch.Tensor:
    """V4.1's clamped SwiGLU times the routing weight, in fp32, rounded to gate.dtype.

    ``silu(min(gate, limit)) * clamp(up, -limit, limit) * route_weight`` (no clamp when limit <= 0).
    gate, up: [..., I]; route_weight: [..., 1] fp32 or None.
    """
    g, u = gate.float(), up.float()
    if swiglu_limit > 0:
        u = u.clamp(-swiglu_limit, swiglu_limit)
        g = g.clamp(max=swiglu_limit)
    h = F.silu(g) * u
    if route_weight is not None:
        h = route_weight.float() * h
    return h.to(gate.dtype)


def swiglu_act_quant_fp8(
    gate: torch.Tensor,
    up: torch.Tensor,
    route_weight: torch.Tensor | None,
    swiglu_limit: float,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clamped SwiGLU (times the routing weight) then per-32 FP8 quantisation, the input of W2."""
    return quant.act_quant_fp8(swiglu(gate, up, route_weight, swiglu_limit))
