"""Attention ops: `sparse_sink_attention` (gathered KV rows, per-head sink).

Tiers: `triton` (the default on a GPU and the portable one: one launch per call on any CUDA GPU
Triton supports), `ref` (torch: the numerics oracle and the CPU path)."""

from __future__ import annotations

import torch

from ..registry import REGISTRY, Implementation
from ._checks import FLOAT_DTYPES, need, need_dtype

REGISTRY.declare(
    "sparse_sink_attention",
    "q [T,H,d], kv [N,d], indices [T,K] (-1 none), sink [H] fp32, scale -> [T,H,d] q.dtype",
)
REGISTRY.register(
    Implementation(
        "sparse_sink_attention", "ref", "deepinfer_kernels.ref.attention:sparse_sink_attention"
    )
)
REGISTRY.register(
    Implementation(
        "sparse_sink_attention",
        "triton",
        "deepinfer_kernels.triton.attention:sparse_sink_attention",
        devices=("cuda",),
        min_capability=(9, 0),
        requires=("triton",),
        supports="deepinfer_kernels.ops.attention:triton_attention_reason",
    )
)

_TRITON_MAX_HEAD_DIM = 1024  # one [heads, d] fp32 accumulator per program must fit on chip


def triton_attention_reason(
    q: torch.Tensor, kv: torch.Tensor, *args: object, **kwargs: object
) -> str | None:
    """Why the triton tier cannot run this call (not on CUDA, not bf16/fp16 q and kv of one
    dtype, head_dim too large), or None. fp32 stays on ref: the kernel's fp32 IEEE dots at
    d = 512 spill registers heavily (ptxas, sm_90)."""
    if q.device.type != "cuda":
        return f"input on {q.device.type}"
    if q.dtype != kv.dtype or q.dtype not in (torch.bfloat16, torch.float16):
        return f"q {q.dtype} and kv {kv.dtype}: needs both bfloat16 or both float16"
    if q.shape[-1] > _TRITON_MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} > {_TRITON_MAX_HEAD_DIM}"
    return None


def _check(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor) -> None:
    need(q.dim() == 3, f"sparse_sink_attention: q must be [T, H, d], got {list(q.shape)}")
    t, h, d = q.shape
    need_dtype(q, "q", *FLOAT_DTYPES)
    need_dtype(kv, "kv", *FLOAT_DTYPES)
    need(
        kv.dim() == 2 and kv.shape[1] == d,
        f"sparse_sink_attention: kv must be [N, {d}], got {list(kv.shape)}",
    )
    need(
        indices.dim() == 2 and indices.shape[0] == t,
        f"sparse_sink_attention: indices must be [{t}, K], got {list(indices.shape)}",
    )
    need_dtype(indices, "indices", torch.int32, torch.int64)
    need(
        tuple(sink.shape) == (h,),
        f"sparse_sink_attention: sink must be [{h}], got {list(sink.shape)}",
    )


def sparse_sink_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of each query row over the KV rows named by `indices` (K = V = kv).

    The per-head `sink` logit enters only the denominator:
    ``p_i = exp(l_i) / (sum_j exp(l_j) + exp(sink_h))``, ``l_i = scale * q . kv_i``.
    q: [T, H, d]; kv: [N, d]; indices: [T, K] int32/int64, -1 = empty slot; returns [T, H, d]
    q.dtype (fp32 math). A row with no valid index returns zeros. The triton tier (CUDA) skips an
    index >= N like -1; the ref tier fails on it.
    """
    _check(q, kv, indices, sink)
    return REGISTRY.call(
        "sparse_sink_attention",
        q,
        kv,
        indices,
        sink,
        scale,
        batch_invariant=REGISTRY.batch_invariant,
    )
