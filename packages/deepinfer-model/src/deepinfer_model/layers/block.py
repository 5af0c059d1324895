"""One V4.1 layer (`Block`): [Engram] -> attention site -> FFN site, with single-pass mHC."""

from __future__ import annotations

import torch
from deepinfer_kernels import ops
from torch import nn

from ..config import ModelConfig
from .attention import Attention
from .engram import Engram
from .linear import RMSNorm
from .mhc import HCSite, hc_params
from .moe import MoE


class Block(nn.Module):
    """One layer: [Engram] -> attention site -> FFN site, single-pass mHC.

    Parameters (HF names): `attn.*`, `ffn.*`, `attn_norm`, `ffn_norm`,
    `hc_{attn,ffn}_{fn [mix, hc*D], base [mix], scale [3]}` (fp32), `engram.*` on Engram layers.
    forward: h [T, hc, D], pre [T, hc] (from the previous FFN site) -> (h', this FFN's pre).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        dtype: torch.dtype,
        device=None,
        fake_quant_kv: bool = True,
        attention_cls: type[nn.Module] = Attention,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        backbone = layer_id < config.num_hidden_layers
        self.attn = attention_cls(config, layer_id, dtype, device, fake_quant_kv)
        n_exp = config.n_routed_experts if backbone else config.dspark_n_routed_experts
        topk = config.num_experts_per_tok if backbone else config.dspark_num_experts_per_tok
        self.ffn = MoE(config, n_exp, topk, dtype, device)
        if backbone and layer_id in config.engram_layer_ids:
            self.engram = Engram(config, layer_id, dtype, device)
        else:
            self.engram = None
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = hc_params(config, device)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = hc_params(config, device)
        self.hc = HCSite(config)

    def forward(
        self, h: torch.Tensor, pre: torch.Tensor, *attn_args
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_pre, post, comb = self.hc.coefficients(
            h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base
        )
        x = self.attn_norm(ops.hc_pre(h, pre))
        h = ops.hc_post(self.attn(x, *attn_args), h, post, comb)
        ffn_pre, post, comb = self.hc.coefficients(
            h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base
        )
        x = self.ffn_norm(ops.hc_pre(h, attn_pre))
        h = ops.hc_post(self.ffn(x), h, post, comb)
        return h, ffn_pre
