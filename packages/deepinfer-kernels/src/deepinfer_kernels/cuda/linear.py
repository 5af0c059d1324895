"""The cuda tier's dense FP8 GEMM (the registry's `fp8_gemm` and `fp8_linear` on Hopper): up to
`decode_gemm.MAX_M` (256) tokens on the decode kernel (`decode_gemm.py`) where `decode_gemm.takes`
says it is the faster, larger M on the prefill kernel (`fp8_gemm.py`). In batch-invariant mode
both give a row the TileLang decode kernel's bits (the same K split and fold order: the decode
kernel always, the prefill kernel with `invariant_config`), so a row's result does not depend on
M across the two either.

``DEEPINFER_KERNELS=fp8_gemm=cuda`` (or ``fp8_linear=cuda``) sends every call here that the
kernels can run, whatever the mode.
"""

from __future__ import annotations

from typing import Any

import torch

from . import decode_gemm, module
from . import fp8_gemm as prefill


def route_reason(
    op: str,
    x: torch.Tensor,
    rows: int,
    w_shape: tuple[int, int],
    batch_invariant: bool,
    out_dtype: torch.dtype,
) -> str | None:
    """Why the registry should not send this call of `op` (on x, `rows` rows times an [N, K]
    weight, writing out_dtype) here (device, mode), or None; with ``DEEPINFER_KERNELS=<op>=cuda``
    every mode."""
    from ..registry import REGISTRY, device_capability

    if x.device.type != "cuda":
        return f"input on {x.device.type}"
    if device_capability(x.device) != (9, 0):
        return "needs sm_90a (Hopper wgmma)"
    if out_dtype not in (torch.bfloat16, torch.float32):
        return f"out_dtype {out_dtype}: the cuda GEMM writes bfloat16 or float32"
    if REGISTRY.settings.overrides.get(op) == "cuda":
        return None
    from ..triton.linear import TILELANG_INVARIANT

    if _decode(rows, w_shape, batch_invariant, x.device) or not batch_invariant:
        return None
    if not (prefill.INVARIANT_PREFILL and TILELANG_INVARIANT):
        return (
            "batch-invariant mode: the decode kernels' K split decides the bits (tilelang, triton)"
        )
    return None


def _decode(
    rows: int, w_shape: tuple[int, int], batch_invariant: bool, device: torch.device
) -> bool:
    """Whether `rows` tokens on an [N, K] weight run on the decode kernel (`decode_gemm.takes`)."""
    n, k = w_shape
    return decode_gemm.takes(rows, n, k, batch_invariant, module.sm_count(device))


def supports(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    batch_invariant: bool = False,
    **_: Any,
) -> str | None:
    """Registry check for `fp8_gemm`: why this tier should not run the call, or None."""
    m = x_fp8.shape[0] if x_fp8.dim() == 2 else 0
    w_shape = (w.shape[0], w.shape[1]) if w.dim() == 2 else (0, 0)  # bad shapes: refused below
    why = route_reason("fp8_gemm", x_fp8, m, w_shape, batch_invariant, out_dtype)
    if why is not None:
        return why
    if _decode(m, w_shape, batch_invariant, x_fp8.device):
        return decode_gemm.call_reason(x_fp8, x_scale, w, w_scale, out_dtype)
    cfg = prefill.call_config(m, *w_shape, batch_invariant, module.sm_count(x_fp8.device))
    return prefill.call_reason(x_fp8, x_scale, w, w_scale, out_dtype, cfg)


def supports_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    batch_invariant: bool = False,
    **_: Any,
) -> str | None:
    """Registry check for `fp8_linear` (x [..., K] float, quantised per 32 first): as `supports`,
    with the activations' own layout (made contiguous by the quantiser) left out."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    w_shape = (w.shape[0], x.shape[-1]) if w.dim() == 2 else (0, 0)  # bad shapes: refused below
    why = route_reason("fp8_linear", x, rows, w_shape, batch_invariant, x.dtype)
    if why is not None:
        return why
    for name, t in (("w", w), ("w_scale", w_scale)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} must be contiguous and 16-byte aligned (the TMA copies it)"
    if w_scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        return f"w_scale is {w_scale.dtype}, the cuda GEMM reads float8_e8m0fnu or float32"
    if w.dim() != 2:
        return f"w must be [N, K], got {list(w.shape)}"
    n, k = w_shape
    if _decode(rows, w_shape, batch_invariant, x.device):
        why = decode_gemm.shape_reason(n, k, rows, sms=module.sm_count(x.device))
    else:
        cfg = prefill.call_config(rows, n, k, batch_invariant, module.sm_count(x.device))
        why = prefill.shape_reason(n, k, cfg)
    return why or module.nvrtc_reason()


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w * w_scale)^T``: x_fp8 [M, K] e4m3, x_scale [M, K/32] fp32, w
    [N, K] e4m3, w_scale [ceil(N/32), K/32] -> [M, N] out_dtype; on the decode kernel where
    `decode_gemm.takes` (M <= 256; the same bits in either mode), else on the prefill kernel
    (batch_invariant: with the decode kernel's K split)."""
    if _decode(x_fp8.shape[0], (w.shape[0], w.shape[1]), batch_invariant, x_fp8.device):
        return decode_gemm.decode_gemm(x_fp8, x_scale, w, w_scale, out_dtype)
    return prefill.fp8_gemm(x_fp8, x_scale, w, w_scale, out_dtype, batch_invariant=batch_invariant)


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, batch_invariant: bool = False
) -> torch.Tensor:
    """x [..., K] bfloat16 or float32 -> [..., N] x.dtype: per-32 FP8 activation quantisation,
    then `fp8_gemm` on w [N, K] e4m3 / w_scale [ceil(N/32), K/32]
    (`triton.quant.quantised_linear`)."""
    from ..triton.quant import quantised_linear

    return quantised_linear(fp8_gemm, x, w, w_scale, batch_invariant=batch_invariant)
