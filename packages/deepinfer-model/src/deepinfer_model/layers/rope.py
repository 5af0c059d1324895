"""RoPE frequencies per layer kind (interleaved pairs on the last `qk_rope_head_dim` dims).

Window-only layers (ratio 0, DSpark stages): theta = `rope_theta`, no YaRN.
Compressed layers (ratio > 0): theta = `compress_rope_theta` with YaRN (no mscale) for q,
window KV, compressed KV, index queries and index keys.
"""

from __future__ import annotations

import math

import torch
from deepinfer_kernels import ops

from ..config import ModelConfig


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float | None = None,
    original_max_position: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """Radians per position of each rotated pair: [dim/2] fp32.

    ``f_i = theta^(-2i/dim)``. With YaRN (`original_max_position > 0`):
    ``low = max(floor(c(beta_fast)), 0)``, ``high = min(ceil(c(beta_slow)), dim-1)`` with
    ``c(r) = dim * ln(original / (r 2 pi)) / (2 ln theta)``; ``s = 1 - clamp((i-low)/(high-low))``
    and ``f_i <- f_i/factor * (1-s) + f_i * s`` (pairs below `low` keep their frequency).
    """
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_max_position > 0 and factor is not None:

        def corrected(rotations: float) -> float:
            return (
                dim
                * math.log(original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(theta))
            )

        low = max(math.floor(corrected(beta_fast)), 0)
        high = min(math.ceil(corrected(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(
            0, 1
        )
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def layer_inv_freq(config: ModelConfig, compress_ratio: int) -> torch.Tensor:
    """The inverse frequencies [rope_dim/2] fp32 a layer with this compress ratio uses."""
    if compress_ratio > 0:
        return yarn_inv_freq(
            config.qk_rope_head_dim,
            config.compress_rope_theta,
            config.rope_factor,
            config.original_max_position_embeddings,
            config.beta_fast,
            config.beta_slow,
        )
    return yarn_inv_freq(config.qk_rope_head_dim, config.rope_theta)


def rope_tail(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rd: int, inverse: bool = False
) -> torch.Tensor:
    """RoPE on the last `rd` dims of x [T, ..., d] (a new tensor)."""
    return torch.cat([x[..., :-rd], ops.rope(x[..., -rd:], positions, inv_freq, inverse)], dim=-1)
