"""CSA2 KV compressor of a kv-source layer (ratio 2 with a softmax gate, or ratio 1).

Ratio r > 1: ``a = wkv(x)``, ``z = wgate(x)`` in fp32 (no APE); entry j pools the r tokens
``j*r .. j*r+r-1`` with a per-channel softmax over tokens: ``L_j = norm(sum_t softmax_t(z) a_t)``.
Ratio 1: ``L_j = norm(wkv(x_j))`` (no gate). `L_j` is the pre-RoPE latent [head_dim].
Parameters: `wkv.weight [head_dim, D]`, `wgate.weight [head_dim, D]` (ratio > 1), `norm.weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import KVCache
from ..config import ModelConfig
from ..step_context import StepContext
from .linear import Linear, RMSNorm


class Compressor(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.ratio = config.compress_ratios[layer_id]
        d, hd = config.hidden_size, config.head_dim
        # the pooling runs in fp32 as in the reference, so its weights are fp32 there
        wdtype = torch.float32 if self.ratio > 1 else dtype
        self.wkv = Linear(d, hd, wdtype, device)
        if self.ratio > 1:
            self.wgate = Linear(d, hd, torch.float32, device)
        self.norm = RMSNorm(hd, config.rms_norm_eps, dtype, device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-token part, x [T, D] (normalised attention input) ->
        ratio > 1: (a = wkv(x), z = wgate(x)), both [T, head_dim] fp32;
        ratio 1: (the latent norm(wkv(x)) [T, head_dim] x.dtype, None): every token closes an
        entry."""
        if self.ratio == 1:
            return self.norm(self.wkv(x)), None
        xf = x.float()
        return self.wkv(xf, torch.float32), self.wgate(xf, torch.float32)

    def forward(
        self, a: torch.Tensor, z: torch.Tensor | None, ctx: StepContext, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """a, z: `project`'s output for this step's T tokens. Returns the entries completed in
        this step: (latent [M, head_dim], seq index [M] int64, entry id [M] int64), and updates
        the slot's partial-group state.
        """
        r = self.ratio
        done = ctx.completed_entries(r, cache.block_size)  # host-built: no sync
        rows, seq, entry = done["rows"], done["seq"], done["entry"]
        if r == 1:
            return a.index_select(0, rows), seq, entry
        state_kv, state_z = cache.comp_kv[self.layer_id], cache.comp_score[self.layer_id]
        s_len = state_kv.shape[1]
        if done["count"]:
            # where each completed entry's r group positions are ([M, r], host-built)
            flat_row, st_slot, st_row, in_chunk = ctx.group_sources(r, s_len)
            in_chunk = in_chunk.bool().unsqueeze(-1)
            ga = torch.where(in_chunk, a[flat_row], state_kv[st_slot, st_row])
            gz = torch.where(in_chunk, z[flat_row], state_z[st_slot, st_row])
            pooled = (ga * torch.softmax(gz, dim=1)).sum(1)  # [M, hd]
            latent = self.norm(pooled.to(self.norm.weight.dtype))
        else:
            latent = a.new_zeros(0, self.norm.weight.shape[0]).to(self.norm.weight.dtype)
        # keep the newest positions of each sequence for groups that close in a later step
        keep, slot, ring_row = ctx.ring_write(s_len)
        state_kv.index_put_((slot, ring_row), a.index_select(0, keep))
        state_z.index_put_((slot, ring_row), z.index_select(0, keep))
        return latent, seq, entry
