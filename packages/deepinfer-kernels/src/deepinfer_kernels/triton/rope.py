"""Triton RoPE on interleaved pairs of the last dim, as `ref/rope.py`: one kernel per call.

x is read through its strides as [T, R, rd] (R = every middle dim collapsed), so the model's
slice ``x[..., -rd:]`` of a wider head needs no copy first. Angles are
``float32(position) * inv_freq`` in fp32 and cos/sin come from libdevice (what torch's CUDA
cos/sin call): the angle reaches ~1e6 radians at long positions, beyond where an approximate sine
is usable. Sizes are runtime ints; the compile-time constants are block shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_BLOCK_R = 8  # rows (heads) per program


@triton.jit
def _cos_sin(a, ACCURATE: tl.constexpr):
    # the interpreter (CPU tests) has no libdevice; its tl.cos/tl.sin are numpy's
    if ACCURATE:
        return libdevice.cos(a), libdevice.sin(a)
    else:
        return tl.cos(a), tl.sin(a)


@triton.jit
def _rope_kernel(
    x_ptr,
    pos_ptr,
    freq_ptr,
    out_ptr,
    R,
    half,
    x_stride_t,
    x_stride_r,
    sin_sign,
    BLOCK_R: tl.constexpr,
    HALF_P: tl.constexpr,
    ACCURATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, HALF_P)
    imask = i < half
    pos = tl.load(pos_ptr + t).to(tl.float32)
    ang = pos * tl.load(freq_ptr + i, mask=imask, other=0.0)  # [HALF_P] fp32
    cos, sin = _cos_sin(ang, ACCURATE)
    sin = sin * sin_sign  # -1 de-rotates (exact)
    mask = (r < R)[:, None] & imask[None, :]
    src = x_ptr + t * x_stride_t + r.to(tl.int64)[:, None] * x_stride_r + 2 * i[None, :]
    a = tl.load(src, mask=mask, other=0.0)
    b = tl.load(src + 1, mask=mask, other=0.0)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    out_a = af * cos[None, :] - bf * sin[None, :]
    out_b = af * sin[None, :] + bf * cos[None, :]
    dst = out_ptr + (t * R + r.to(tl.int64)[:, None]) * (2 * half) + 2 * i[None, :]
    tl.store(dst, out_a.to(a.dtype), mask=mask)
    tl.store(dst + 1, out_b.to(a.dtype), mask=mask)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x [T, ..., rd] -> a [T, R, rd] view with unit last stride (a contiguous copy if the middle
    dims cannot be collapsed into one stride)."""
    t, rd = x.shape[0], x.shape[-1]
    if x.dim() == 2:
        v = x.unsqueeze(1)
    else:
        try:
            v = x.view(t, -1, rd)
        except RuntimeError:
            v = x.contiguous().view(t, -1, rd)
    if rd > 1 and v.stride(2) != 1:
        v = v.contiguous()
    return v


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    **_: object,
) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of the last dim by ``positions[t] * inv_freq[i]``.

    x [T, ..., rd] (x.dim() >= 2); positions [T] int or float; inv_freq [rd/2] fp32.
    Returns a new contiguous tensor of x's shape and dtype.
    """
    if x.dim() < 2:
        raise ValueError(f"rope: x must be [T, ..., rd], got shape {list(x.shape)}")
    t, rd = x.shape[0], x.shape[-1]
    if rd != 2 * inv_freq.shape[0]:
        raise ValueError(f"rope: last dim {rd} must be 2 * len(inv_freq) = {2 * inv_freq.shape[0]}")
    if positions.shape != (t,):
        raise ValueError(f"rope: positions must be [{t}], got {list(positions.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    v = _rows_view(x)
    n_rows = v.shape[1]
    if n_rows:
        half = rd // 2
        _rope_kernel[(t, triton.cdiv(n_rows, _BLOCK_R))](
            v,
            positions.contiguous(),
            inv_freq.float().contiguous(),
            out,
            n_rows,
            half,
            v.stride(0),
            v.stride(1),
            -1.0 if inverse else 1.0,
            BLOCK_R=_BLOCK_R,
            HALF_P=triton.next_power_of_2(half),
            ACCURATE=type(_rope_kernel).__name__ != "InterpretedFunction",
            num_warps=2,
        )
    return out
