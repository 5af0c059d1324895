"""Reference FP8 block-scaled linear: per-32 FP8 activations times 32x32-block FP8 weights.

Both operands are dequantised exactly to fp32 (e4m3 times a power of two) and multiplied with fp32
accumulation, so the result equals the reference model's ``fp8_gemm`` up to summation order. In
batch-invariant mode each row is its own [1, K] x [K, N] product, so a row's result cannot depend
on how many rows share the call.
"""

from __future__ import annotations

import torch

from .. import quant


def matmul_rows(a: torch.Tensor, b_t: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """a [M, K] @ b_t [K, N] in a's dtype; row by row when `batch_invariant`."""
    if not batch_invariant or a.shape[0] <= 1:
        return a @ b_t
    out = a.new_empty(a.shape[0], b_t.shape[1])
    for i in range(a.shape[0]):
        out[i : i + 1] = a[i : i + 1] @ b_t
    return out


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """x_fp8 [M, K] e4m3 with x_scale [M, K/32] fp32, w [N, K] e4m3 with w_scale
    [ceil(N/32), K/32] e8m0 -> [M, N] out_dtype (fp32 accumulation)."""
    xd = quant.act_dequant_fp8(x_fp8, x_scale, torch.float32)
    wd = quant.dequantize_fp8_blocks(w, w_scale, torch.float32)
    return matmul_rows(xd, wd.t(), batch_invariant).to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """x [..., K] -> [..., N] x.dtype: quantise x per 32 (UE8M0), then `fp8_gemm`."""
    xq, xs = quant.act_quant_fp8(x.reshape(-1, x.shape[-1]))
    y = fp8_gemm(xq, xs, w, w_scale, x.dtype, batch_invariant=batch_invariant)
    return y.reshape(*x.shape[:-1], w.shape[0])
