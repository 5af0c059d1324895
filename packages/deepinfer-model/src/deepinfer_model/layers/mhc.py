"""Single-pass mHC (manifold-constrained hyper-connections) for one sublayer site.

The residual stream is `hc_mult` copies h: [T, hc, D]. A site's parameters are `fn [mix, hc*D]`,
`base [mix]`, `scale [3]` (fp32; mix = (2+hc)*hc). V4.1 is single-pass: the `pre` coefficients a
site computes collapse the streams for the *next* site (attention uses the previous FFN's `pre`,
the FFN uses this layer's attention `pre`; layer 0 uses a one-hot mix on stream 0).
"""

from __future__ import annotations

import torch
from deepinfer_kernels import ops
from torch import nn

from ..config import ModelConfig


class HCSite(nn.Module):
    """Coefficients of one site. Parameters are registered on the owner (`hc_attn_fn`, ...)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.hc = config.hc_mult
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps

    def coefficients(
        self, h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, hc, D] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (fp32)."""
        mixes = ops.hc_mixes(h, fn, self.norm_eps)
        return ops.hc_split_sinkhorn(mixes, scale, base, self.hc, self.iters, self.hc_eps)


def identity_pre(num_tokens: int, hc: int, device: torch.device) -> torch.Tensor:
    """The one-hot mix [T, hc] (stream 0) that layer 0's attention collapses with."""
    pre = torch.zeros(num_tokens, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre


def hc_params(config: ModelConfig, device=None) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """Fresh (fn [mix, hc*D], base [mix], scale [3]) fp32 parameters of one site."""
    mix = config.hc_mix_dim

    def mk(*s):
        return nn.Parameter(
            torch.zeros(*s, dtype=torch.float32, device=device), requires_grad=False
        )

    return mk(mix, config.hc_mult * config.hidden_size), mk(mix), mk(3)
