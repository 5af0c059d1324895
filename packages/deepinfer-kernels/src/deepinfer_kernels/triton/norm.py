"""Triton RMSNorm: one program per row, fp32 statistics, as `ref/norm.py`.

The row's sum of squares is one reduction in a fixed order inside its own program, so a token's
result does not depend on how many rows the call has (batch invariant). Sizes are runtime ints;
only the block width is a compile-time constant (one compile per dtype and power-of-two width).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import rsqrt

_MAX_BLOCK = 8192  # widest row held in registers at once; wider rows take two passes over chunks


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    d,
    x_row_stride,
    eps,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    ACCURATE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * d
    col = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = col < d
        x = tl.load(x_row + col, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        r = rsqrt(tl.sum(xf * xf, axis=0) / d + eps, ACCURATE)
        w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + col, (w * (xf * r)).to(x.dtype), mask=mask)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, d, BLOCK):
            c = start + col
            xf = tl.load(x_row + c, mask=c < d, other=0.0).to(tl.float32)
            acc += xf * xf
        r = rsqrt(tl.sum(acc, axis=0) / d + eps, ACCURATE)
        for start in range(0, d, BLOCK):
            c = start + col
            mask = c < d
            x = tl.load(x_row + c, mask=mask, other=0.0)
            w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + c, (w * (x.to(tl.float32) * r)).to(x.dtype), mask=mask)


def _interpreted(kernel: object) -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests), where libdevice is unavailable."""
    return type(kernel).__name__ == "InterpretedFunction"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, **_: object) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d] x.dtype: ``weight * x * rsqrt(mean(x^2) + eps)``."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight must be [{d}], got {list(weight.shape)}")
    x2 = x.reshape(-1, d)  # a view when the rows can be addressed with one stride
    if d > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and d:
        block = min(triton.next_power_of_2(d), _MAX_BLOCK)
        _rms_norm_kernel[(rows,)](
            x2,
            weight,
            out,
            d,
            x2.stride(0),
            float(eps),
            BLOCK=block,
            ONE_PASS=d <= block,
            ACCURATE=not _interpreted(_rms_norm_kernel),
            num_warps=8 if block >= 4096 else 4,
        )
    return out
