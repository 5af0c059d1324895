"""Dense FP8 linear ops: 32x32-block FP8 e4m3 weights (UE8M0 scales) times per-32 FP8 activations,
fp32 accumulation. `fp8_linear` takes bf16/fp32 activations and quantises them; `fp8_gemm` takes
activations already quantised (e.g. by `ops.rms_norm_act_quant_fp8`)."""

from __future__ import annotations

import torch

from ..quant import FP8_BLOCK
from ..registry import REGISTRY, Implementation
from ._checks import FLOAT_DTYPES, need_dtype

REGISTRY.declare(
    "fp8_gemm",
    "x_fp8 [M, K] e4m3, x_scale [M, K/32] fp32, w [N, K] e4m3, w_scale [N/32, K/32] e8m0 -> [M, N]",
)
REGISTRY.declare(
    "fp8_linear", "x [..., K] float, w [N, K] e4m3, w_scale [N/32, K/32] e8m0 -> [..., N] x.dtype"
)

for _op in ("fp8_gemm", "fp8_linear"):
    REGISTRY.register(Implementation(_op, "ref", f"deepinfer_kernels.ref.linear:{_op}"))
    REGISTRY.register(
        Implementation(
            _op,
            "triton",
            f"deepinfer_kernels.triton.linear:{_op}",
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("triton",),
            supports="deepinfer_kernels.ops._checks:cuda_input_reason",
            routing=(
                "M=1 CUDA-core GEMV (auto mode); M=2..64, and every M in batch-invariant mode, the "
                "TileLang decode kernel where tilelang imports and K % 128 == 0; else Triton tiles"
            ),
        )
    )

# TileLang FP8-wgmma GEMM with per-32 promotion: the prefill GEMMs on Hopper that the cuda tier
# (below; tried first, settings.TIERS) declines (no NVRTC, or a shape it refuses; see
# `tilelang.fp8_gemm._route_reason`); decode sizes the cuda tier declines go to the triton tier
# (which routes M = 2..64 to the TileLang decode kernel).
for _op, _check in (("fp8_gemm", "supports"), ("fp8_linear", "supports_linear")):
    REGISTRY.register(
        Implementation(
            _op,
            "tilelang",
            f"deepinfer_kernels.tilelang.fp8_gemm:{_op}",
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("tilelang",),
            supports=f"deepinfer_kernels.tilelang.fp8_gemm:{_check}",
            routing="M > 64 where the cuda tier declines",
        )
    )

# CUDA C++ FP8-wgmma GEMMs with per-32 promotion (`cuda/linear.py`): on Hopper the decode kernel
# up to M = 256 where it is the faster (swap-AB up to 32 tokens; `decode_gemm.takes`) and the
# prefill kernel otherwise, in both modes (the TileLang decode kernel's bits in batch-invariant
# mode), faster than the TileLang and Triton kernels.
for _op, _check in (("fp8_gemm", "supports"), ("fp8_linear", "supports_linear")):
    REGISTRY.register(
        Implementation(
            _op,
            "cuda",
            f"deepinfer_kernels.cuda.linear:{_op}",
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("triton",),  # the decode routing constants; fp8_linear's quantiser
            supports=f"deepinfer_kernels.cuda.linear:{_check}",
            routing=(
                "M <= 192 (256 for N < 2048, or batch-invariant) the decode kernel (K split <= "
                "8) but where decode_gemm.ROUTES measured the prefill kernel faster, larger M the "
                "prefill kernel (batch-invariant mode: the decode kernel's K split)"
            ),
        )
    )


# The checks of the two GEMM ops run on every call (eager prefill, graph capture): their messages
# are built only when a check fails.


def _check_weight(w: torch.Tensor, w_scale: torch.Tensor, k: int) -> None:
    need_dtype(w, "w", torch.float8_e4m3fn)
    if not (w.dim() == 2 and w.shape[1] == k):
        raise ValueError(f"w must be [N, {k}], got {list(w.shape)}")
    want = (-(-w.shape[0] // FP8_BLOCK), -(-k // FP8_BLOCK))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"w_scale must be {list(want)}, got {list(w_scale.shape)}")
    need_dtype(w_scale, "w_scale", torch.float8_e8m0fnu, torch.float32)


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w * w_scale)^T`` with fp32 accumulation.

    x_fp8 [M, K] e4m3 (K % 32 == 0), x_scale [M, K/32] fp32 powers of two, w [N, K] e4m3,
    w_scale [ceil(N/32), K/32] e8m0 (or fp32 powers of two) -> [M, N] out_dtype.
    """
    need_dtype(x_fp8, "x_fp8", torch.float8_e4m3fn)
    if x_fp8.dim() != 2:
        raise ValueError(f"x_fp8 must be [M, K], got {list(x_fp8.shape)}")
    m, k = x_fp8.shape
    if k % FP8_BLOCK:
        raise ValueError(f"x_fp8: K must be a multiple of {FP8_BLOCK}, got {k}")
    if tuple(x_scale.shape) != (m, k // FP8_BLOCK) or x_scale.dtype != torch.float32:
        raise ValueError(
            f"x_scale must be [{m}, {k // FP8_BLOCK}] fp32, got {list(x_scale.shape)} "
            f"{x_scale.dtype}"
        )
    _check_weight(w, w_scale, k)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    return REGISTRY.call(
        "fp8_gemm", x_fp8, x_scale, w, w_scale, out_dtype, batch_invariant=REGISTRY.batch_invariant
    )


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32, K % 32 == 0) -> [..., N] x.dtype.

    x is quantised per 32 channels to FP8 e4m3 with UE8M0 scales (as the reference), multiplied by
    the block-scaled FP8 weight w [N, K] / w_scale [ceil(N/32), K/32] with fp32 accumulation.
    """
    need_dtype(x, "x", *FLOAT_DTYPES)
    k = x.shape[-1]
    if k % FP8_BLOCK:
        raise ValueError(f"x: last dimension must be a multiple of {FP8_BLOCK}, got {k}")
    _check_weight(w, w_scale, k)
    return REGISTRY.call("fp8_linear", x, w, w_scale, batch_invariant=REGISTRY.batch_invariant)
