"""Activation quantisation ops: FP8 e4m3 per 32 channels with power-of-two (UE8M0) scales, alone
and fused with the op that produces the activation (RMSNorm; clamped SwiGLU times the routing
weight). The outputs feed `ops.fp8_gemm`."""

from __future__ import annotations

import torch

from ..quant import FP8_BLOCK
from ..registry import REGISTRY, Implementation
from ._checks import FLOAT_DTYPES, need, need_dtype

REGISTRY.declare(
    "act_quant_fp8", "x [..., K] -> (x_fp8 [..., K] e4m3, scale [..., K/32] fp32 powers of two)"
)
REGISTRY.declare(
    "rms_norm_act_quant_fp8",
    "RMSNorm(x [..., K], weight [K], eps) then act_quant_fp8 -> (x_fp8, scale [..., K/32])",
)
REGISTRY.declare(
    "swiglu_act_quant_fp8",
    "silu(min(gate, L)) * clamp(up, +-L) * route_weight [..., 1], then act_quant_fp8",
)

for _op in ("act_quant_fp8", "rms_norm_act_quant_fp8", "swiglu_act_quant_fp8"):
    REGISTRY.register(Implementation(_op, "ref", f"deepinfer_kernels.ref.quant:{_op}"))
    REGISTRY.register(
        Implementation(
            _op,
            "triton",
            f"deepinfer_kernels.triton.quant:{_op}",
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("triton",),
            supports="deepinfer_kernels.ops._checks:cuda_input_reason",
        )
    )


def _check_k(x: torch.Tensor, name: str) -> None:
    need_dtype(x, name, *FLOAT_DTYPES)
    need(
        x.dim() >= 1 and x.shape[-1] % FP8_BLOCK == 0,
        f"{name}: last dimension must be a multiple of {FP8_BLOCK}, got shape {tuple(x.shape)}",
    )


def act_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 32 == 0) -> (x_fp8 [..., K] float8_e4m3fn, scale [..., K/32] fp32).

    ``scale = 2**ceil(log2(max(amax, 1e-4) / 448))`` per 32 channels; ``x ~= x_fp8 * scale``.
    """
    _check_k(x, "x")
    return REGISTRY.call("act_quant_fp8", x)


def rms_norm_act_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``act_quant_fp8(rms_norm(x, weight, eps))`` in one pass; the normed value is rounded to
    x.dtype first, as the unfused chain does.

    x [..., K], weight [K] -> (x_fp8 [..., K], scale [..., K/32]).
    """
    _check_k(x, "x")
    need(
        weight.shape == (x.shape[-1],),
        f"weight must be [{x.shape[-1]}], got {list(weight.shape)}",
    )
    return REGISTRY.call("rms_norm_act_quant_fp8", x, weight, eps)


def swiglu_act_quant_fp8(
    gate: torch.Tensor,
    up: torch.Tensor,
    route_weight: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4.1's expert activation, quantised for W2: gate, up [..., I]; route_weight [..., 1] fp32 or
    None; limit <= 0 disables the clamp. -> (h_fp8 [..., I], scale [..., I/32] fp32)."""
    _check_k(gate, "gate")
    need(up.shape == gate.shape, f"up must have gate's shape {list(gate.shape)}, got {up.shape}")
    if route_weight is not None:
        need(
            route_weight.shape == (*gate.shape[:-1], 1),
            f"route_weight must be {[*gate.shape[:-1], 1]}, got {list(route_weight.shape)}",
        )
    return REGISTRY.call("swiglu_act_quant_fp8", gate, up, route_weight, float(swiglu_limit))
