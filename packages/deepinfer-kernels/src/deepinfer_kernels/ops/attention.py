"""Attention ops: `sparse_sink_attention` (gathered KV rows, per-head sink)."""

from __future__ import annotations

import torch

from ..registry import REGISTRY, Implementation

REGISTRY.declare(
    "sparse_sink_attention",
    "q [T,H,d], kv [N,d], indices [T,K] (-1 none), sink [H] fp32, scale -> [T,H,d] q.dtype",
)
REGISTRY.register(
    Implementation(
        "sparse_sink_attention", "ref", "deepinfer_kernels.ref.attention:sparse_sink_attention"
    )
)


def sparse_sink_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of each query row over the KV rows named by `indices` (K = V = kv).

    The per-head `sink` logit enters only the denominator:
    ``p_i = exp(l_i) / (sum_j exp(l_j) + exp(sink_h))``, ``l_i = scale * q . kv_i``.
    q: [T, H, d]; kv: [N, d]; indices: [T, K] int, -1 = empty slot; returns [T, H, d].
    """
    return REGISTRY.call(
        "sparse_sink_attention",
        q,
        kv,
        indices,
        sink,
        scale,
        batch_invariant=REGISTRY.batch_invariant,
    )
