"""Single-pass mHC ops: `hc_mixes`, `hc_split_sinkhorn`, `hc_pre`, `hc_post`.

Tiers: `triton` (the default on a GPU and the portable one: one launch per call on any CUDA GPU
Triton supports), `ref` (torch: the numerics oracle and the CPU path)."""

from __future__ import annotations

import torch

from ..registry import REGISTRY, Implementation
from ._checks import cuda_input_reason

REGISTRY.declare("hc_mixes", "h [T,hc,D], fn [mix,hc*D], norm_eps -> [T,mix] fp32")
REGISTRY.declare(
    "hc_split_sinkhorn",
    "mixes [T,mix], scale [3], base [mix], hc, iters, eps -> pre, post [T,hc], comb [T,hc,hc]",
)
REGISTRY.declare("hc_pre", "h [T,hc,D], pre [T,hc] -> [T,D]")
REGISTRY.declare("hc_post", "y [T,D], residual [T,hc,D], post [T,hc], comb [T,hc,hc] -> [T,hc,D]")
_SUPPORTS = {
    "hc_mixes": "deepinfer_kernels.ops.mhc:mixes_triton_reason",
    "hc_split_sinkhorn": "deepinfer_kernels.ops.mhc:sinkhorn_triton_reason",
    "hc_pre": "deepinfer_kernels.ops._checks:cuda_input_reason",
    "hc_post": "deepinfer_kernels.ops._checks:cuda_input_reason",
}
for _op in ("hc_mixes", "hc_split_sinkhorn", "hc_pre", "hc_post"):
    REGISTRY.register(Implementation(_op, "ref", f"deepinfer_kernels.ref.mhc:{_op}"))
    REGISTRY.register(
        Implementation(
            _op,
            "triton",
            f"deepinfer_kernels.triton.mhc:{_op}",
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("triton",),
            supports=_SUPPORTS[_op],
        )
    )

_MIXES_TRITON_MAX_T = 128
"""Above this many tokens the triton `hc_mixes` (an fp32 FMA dot) is slower than the ref tier's
cuBLAS GEMM (PERF.md), so outside batch-invariant mode larger calls go to ref."""


def mixes_triton_reason(
    h: torch.Tensor, fn, norm_eps, *_, batch_invariant: bool = False, **__
) -> str | None:
    """Why the triton `hc_mixes` should not run this call, or None. In batch-invariant mode it
    runs at every T (it is invariant by construction; cuBLAS is not); otherwise only up to
    `_MIXES_TRITON_MAX_T` tokens."""
    why = cuda_input_reason(h)
    if why is None and not batch_invariant and h.shape[0] > _MIXES_TRITON_MAX_T:
        why = (
            f"T = {h.shape[0]} > {_MIXES_TRITON_MAX_T} outside batch-invariant mode "
            "(the ref tier's GEMM is faster there)"
        )
    return why


_SINKHORN_MAX_HC = 16  # the triton kernel holds a token's [hc, hc] matrix in registers


def sinkhorn_triton_reason(mixes: torch.Tensor, scale, base, hc_mult, *_, **__) -> str | None:
    """Why the triton `hc_split_sinkhorn` cannot run this call (input not on CUDA, hc too large),
    or None."""
    why = cuda_input_reason(mixes)
    if why is None and int(hc_mult) > _SINKHORN_MAX_HC:
        why = f"hc_mult {hc_mult} > {_SINKHORN_MAX_HC}"
    return why


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``(flat(h) . fn^T) * rsqrt(mean(flat(h)^2) + norm_eps)``: [T, hc, D] -> [T, mix] fp32."""
    return REGISTRY.call("hc_mixes", h, fn, norm_eps, batch_invariant=REGISTRY.batch_invariant)


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_mult: int,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre = sigmoid + eps, post = 2 sigmoid, comb = Sinkhorn(softmax + eps) (see ref.mhc)."""
    return REGISTRY.call("hc_split_sinkhorn", mixes, scale, base, hc_mult, iters, eps)


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_k pre[:, k] * h[:, k]``: [T, hc, D] -> [T, D]."""
    return REGISTRY.call("hc_pre", h, pre)


def hc_post(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``out[k] = post[k] y + sum_j comb[j, k] residual[j]``: -> [T, hc, D]."""
    return REGISTRY.call("hc_post", y, residual, post, comb)
