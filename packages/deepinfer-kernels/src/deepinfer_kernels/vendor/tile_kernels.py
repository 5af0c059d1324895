"""Activation quantisation from DeepSeek's TileKernels (PyPI `tile-kernels`, TileLang kernels):
`act_quant_fp8` by `per_token_cast` at 32 channels per scale with the scales rounded up to powers
of two (`round_sf`), as fp32 [rows, K / 32]: the reference's format and arithmetic, bit for bit
(amax floored at 1e-4, the library's default clamp), about as fast as the triton tier (PERF.md).
TileKernels is not a dependency: install it with `pip install --no-deps tile-kernels` (its
metadata asks for a newer torch than it needs).

Its other kernels are not used: its fused RMSNorm + cast is no faster than ours, its SwiGLU casts
the fp32 product without the reference's rounding to bf16 first, its gate takes logits (the gate
GEMM is ours)."""

from __future__ import annotations

import functools

import torch

from ..ops._checks import cuda_input_reason
from ..quant import ACT_AMAX_FLOOR, FP8_BLOCK

_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def import_reason() -> str | None:
    """Why `tile_kernels` does not import here (it is installed: the registry checked), or None.
    Asked once per process: a failed import (say TileLang missing, or its CUDA set-up failing)
    makes the tier decline instead of failing the call."""
    try:
        import tile_kernels  # noqa: F401
    except Exception as exc:  # a third-party import can fail in many ways; any means "not here"
        return f"tile_kernels does not import: {type(exc).__name__}: {exc}"
    return None


def quant_reason(x: torch.Tensor, *_: object, **__: object) -> str | None:
    """Why `act_quant_fp8` cannot take x [..., K] here, or None: CUDA, bf16 or fp32, K a multiple
    of 64 (the library's), the library importable, and its amax clamp left at the reference's
    floor (`tile_kernels.set_amax_clamp_for_quant` is process-wide)."""
    if x.dtype not in _DTYPES:
        return f"x is {x.dtype}; TileKernels casts bf16 or fp32"
    if x.shape[-1] % 64:
        return f"K={x.shape[-1]}; TileKernels' per-token cast takes a multiple of 64"
    if (why := cuda_input_reason(x) or import_reason()) is not None:
        return why
    from tile_kernels import get_amax_clamp_for_quant

    clamp = get_amax_clamp_for_quant("e4m3", False)
    if clamp != ACT_AMAX_FLOOR:
        return f"tile_kernels' e4m3 amax clamp is {clamp}, not the reference's {ACT_AMAX_FLOOR}"
    return None


def act_quant_fp8(x: torch.Tensor, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_fp8 [..., K] e4m3, scale [..., K/32] fp32 powers of two)."""
    from tile_kernels.quant import per_token_cast

    k = x.shape[-1]
    q, s = per_token_cast(x.contiguous().view(-1, k), "e4m3", FP8_BLOCK, round_sf=True)
    return q.view(x.shape), s.view(*x.shape[:-1], k // FP8_BLOCK)
