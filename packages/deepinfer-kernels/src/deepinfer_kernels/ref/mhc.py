"""Manifold-constrained hyper-connections (single-pass mHC), in torch (the `ref` tier)."""

from __future__ import annotations

import torch

from .linear import matmul_rows


def hc_mixes(
    h: torch.Tensor, fn: torch.Tensor, norm_eps: float, *, batch_invariant: bool = False
) -> torch.Tensor:
    """Mixing logits of the residual streams. h: [T, hc, D]; fn: [mix, hc*D] fp32.

    ``m = (flat(h) . fn^T) * rsqrt(mean(flat(h)^2) + norm_eps)``, one statistic per token over
    all hc*D values. Returns [T, mix] fp32.
    """
    x = h.flatten(1).float()
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return matmul_rows(x, fn.float().t(), batch_invariant) * rstd


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_mult: int,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split [T, (2+hc)*hc] mixing logits into pre [T,hc], post [T,hc], comb [T,hc,hc] (fp32).

    ``pre = sigmoid(m[:hc] s0 + b) + eps``; ``post = 2 sigmoid(m[hc:2hc] s1 + b)``;
    ``comb = softmax_row(m[2hc:] s2 + b) + eps``, then one column normalisation and `iters - 1`
    (row, column) normalisations, each dividing by (sum + eps). comb[j, k] mixes stream j into k.
    """
    hc = hc_mult
    m, s, b = mixes.float(), scale.float(), base.float()
    pre = torch.sigmoid(m[:, :hc] * s[0] + b[:hc]) + eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc])
    comb = (m[:, 2 * hc :] * s[2] + b[2 * hc :]).view(-1, hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse the streams: [T, hc, D] x [T, hc] -> [T, D] in h.dtype (fp32 sum)."""
    return (pre.float().unsqueeze(-1) * h.float()).sum(1).to(h.dtype)


def hc_post(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Expand back: ``out[k] = post[k] * y + sum_j comb[j, k] * residual[j]``.

    y: [T, D]; residual: [T, hc, D]; post: [T, hc]; comb: [T, hc, hc]. Returns [T, hc, D] y.dtype.
    """
    out = post.float().unsqueeze(-1) * y.float().unsqueeze(1)
    res = residual.float()
    for j in range(res.shape[1]):  # elementwise, so every row is computed alike
        out = out + comb[:, j, :].float().unsqueeze(-1) * res[:, j : j + 1, :]
    return out.to(y.dtype)
