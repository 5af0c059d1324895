"""Rotary position embedding on interleaved pairs, in torch (the `ref` tier)."""

from __future__ import annotations

import torch


def rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` of the last dim by ``positions * inv_freq[i]``.

    x: [T, ..., rd]; positions: [T] (int or float); inv_freq: [rd/2] fp32 (radians per position).
    `inverse` rotates by the negative angle (used to de-rotate the attention output).
    Angles are ``float32(position) * inv_freq`` in fp32, as the reference precomputes them.
    Returns a new tensor of x's shape and dtype.
    """
    t, rd = x.shape[0], x.shape[-1]
    if rd != 2 * inv_freq.shape[0]:
        raise ValueError(f"rope: last dim {rd} must be 2 * len(inv_freq) = {2 * inv_freq.shape[0]}")
    if positions.shape != (t,):
        raise ValueError(f"rope: positions must be [{t}], got {list(positions.shape)}")
    ang = positions.to(torch.float32).unsqueeze(-1) * inv_freq.float()  # [T, rd/2]
    ang = ang.view(t, *([1] * (x.dim() - 2)), rd // 2)
    cos, sin = torch.cos(ang), torch.sin(ang)
    if inverse:
        sin = -sin
    pairs = x.float().unflatten(-1, (rd // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)
