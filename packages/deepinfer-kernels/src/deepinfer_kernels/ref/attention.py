"""Sparse attention with a per-head sink, in torch (the `ref` tier)."""

from __future__ import annotations

import torch

_CHUNK = 256  # query rows per step, bounding the gathered [rows, K, d] buffer


def sparse_sink_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Each query row attends to the KV rows its `indices` name; -1 entries are ignored.

    q: [T, H, d]; kv: [N, d] (K = V, one shared latent head); indices: [T, K] int (-1 = none);
    sink: [H] fp32 learned logit that only enters the denominator; scale: softmax scale.
    ``o[t,h] = sum_i exp(l_i) kv_i / (sum_i exp(l_i) + exp(sink_h))``, ``l_i = scale q.kv_i``.
    A row with no valid index returns zeros. fp32 math; returns q.dtype [T, H, d].
    """
    t, h, d = q.shape
    if kv.dim() != 2 or kv.shape[1] != d:
        raise ValueError(f"sparse_sink_attention: kv must be [N, {d}], got {list(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(
            f"sparse_sink_attention: indices must be [{t}, K], got {list(indices.shape)}"
        )
    if sink.shape != (h,):
        raise ValueError(f"sparse_sink_attention: sink must be [{h}], got {list(sink.shape)}")
    out = torch.zeros(t, h, d, dtype=torch.float32, device=q.device)
    if indices.shape[1] == 0 or kv.shape[0] == 0:
        return out.to(q.dtype)
    kvf = kv.float()
    sinkf = sink.float()
    step = 1 if batch_invariant else _CHUNK
    for s in range(0, t, step):
        idx = indices[s : s + step].long()
        valid = idx >= 0
        keys = kvf[idx.clamp_min(0)]  # [c, K, d]
        logits = torch.einsum("chd,ckd->chk", q[s : s + step].float(), keys) * scale
        logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m = torch.maximum(logits.amax(-1), sinkf)  # [c, H]; finite thanks to the sink
        p = torch.exp(logits - m.unsqueeze(-1))
        denom = p.sum(-1) + torch.exp(sinkf - m)
        out[s : s + step] = torch.einsum("chk,ckd->chd", p, keys) / denom.unsqueeze(-1)
    return out.to(q.dtype)
