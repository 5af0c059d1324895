"""Reference activation quantisation: FP8 e4m3 per 32 channels with power-of-two scales
(`quant.act_quant_fp8`, which defines the numerics)."""

from __future__ import annotations

import torch

from .. import quant


def act_quant_fp8(x: torch.Tensor, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_fp8 [..., K] e4m3, scale [..., K/32] fp32 powers of two)."""
    return quant.act_quant_fp8(x)
