"""One V4.1 layer (`Block`): [Engram] -> attention site -> FFN site, with single-pass mHC."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from deepinfer_kernels import ops
from torch import nn

from ..cache import KVCache
from ..config import ModelConfig
from ..step_context import StepContext
from .attention import Attention, Projections
from .engram import Engram
from .linear import RMSNorm
from .mhc import HCSite, hc_params
from .moe import MoE

if TYPE_CHECKING:
    from ..rank_shard import RankShard


@dataclass
class AttentionInputs:
    """A layer's state at its attention core (`Block.enter`), all per token [T, ...]:
    h [T, hc, D] the residual streams; attn_pre [T, hc] this site's `pre` (collapses the streams
    for the FFN); post [T, hc], comb [T, hc, hc] (fp32) expand the attention output back; x
    [T, D] the normed attention input; proj its projections (`Attention.project`)."""

    h: torch.Tensor
    attn_pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    x: torch.Tensor
    proj: Projections

    def select(self, rows: torch.Tensor) -> AttentionInputs:
        """Rows `rows` [T'] (device int64) of every tensor."""
        return AttentionInputs(
            *(t.index_select(0, rows) for t in (self.h, self.attn_pre, self.post, self.comb)),
            self.x.index_select(0, rows),
            self.proj.select(rows),
        )


class Block(nn.Module):
    """One layer: [Engram] -> attention site -> FFN site, single-pass mHC.

    Parameters (HF names): `attn.*`, `ffn.*`, `attn_norm`, `ffn_norm`,
    `hc_{attn,ffn}_{fn [mix, hc*D], base [mix], scale [3]}` (fp32), `engram.*` on Engram layers.
    forward: h [T, hc, D], pre [T, hc] (from the previous FFN site) -> (h', this FFN's pre).
    shard: this rank's part under expert / Engram parallelism (backbone layers only).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        dtype: torch.dtype,
        device=None,
        fake_quant_kv: bool = True,
        attention_cls: type[nn.Module] = Attention,
        shard: RankShard | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        backbone = layer_id < config.num_hidden_layers
        if shard is not None and not backbone:
            raise ValueError(f"Block {layer_id}: only backbone layers are sharded")
        self.attn = attention_cls(config, layer_id, dtype, device, fake_quant_kv)
        n_exp = config.n_routed_experts if backbone else config.dspark_n_routed_experts
        topk = config.num_experts_per_tok if backbone else config.dspark_num_experts_per_tok
        self.ffn = MoE(config, n_exp, topk, dtype, device, shard=shard, layer=layer_id)
        if backbone and layer_id in config.engram_layer_ids:
            self.engram = Engram(config, layer_id, dtype, device, shard)
        else:
            self.engram = None
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = hc_params(config, device)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = hc_params(config, device)
        self.hc = HCSite(config)

    def forward(
        self, h: torch.Tensor, pre: torch.Tensor, ctx: StepContext, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hc, D], pre [T, hc] -> (h', this FFN site's pre). `ctx` is the step's context
        (a DSpark stage passes its draft context, which has `positions` too)."""
        s = self.enter(h, pre, ctx.positions)
        return self.leave(self.attn.attend(s.x, s.proj, ctx, cache), s, ctx.positions)

    def enter(self, h: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor) -> AttentionInputs:
        """Everything per token before the attention core: the site's mHC coefficients, the
        stream collapse with `pre` [T, hc], the norm and the projections at `positions` [T]."""
        attn_pre, post, comb = self.hc.coefficients(
            h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base
        )
        x = self.attn_norm(ops.hc_pre(h, pre))
        return AttentionInputs(h, attn_pre, post, comb, x, self.attn.project(x, positions))

    def leave(
        self, o: torch.Tensor, s: AttentionInputs, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything per token after the attention core: o [T, H, head_dim] -> (h' [T, hc, D],
        this FFN site's pre [T, hc])."""
        h = ops.hc_post(self.attn.output(o, positions), s.h, s.post, s.comb)
        ffn_pre, post, comb = self.hc.coefficients(
            h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base
        )
        x = self.ffn_norm(ops.hc_pre(h, s.attn_pre))
        h = ops.hc_post(self.ffn(x), h, post, comb)
        return h, ffn_pre
