"""The public op functions. Each topic module declares its ops and registers their tiers.

Call these (never a tier directly): ``from deepinfer_kernels import ops; ops.rms_norm(x, w, eps)``.
"""

from .attention import sparse_sink_attention
from .engram import engram_gate
from .indexer import candidate_blocks, index_topk, indexer_scores
from .linear import fp8_gemm, fp8_linear
from .mhc import hc_mixes, hc_post, hc_pre, hc_split_sinkhorn
from .moe import moe_experts, moe_fragment_order_pays, moe_gate
from .norm import rms_norm
from .quant import (
    act_quant_fp8,
    fake_quant_fp4_e4m3_scale,
    fake_quant_fp4_ue8m0,
    fake_quant_fp8_ue8m0,
)
from .rope import rope

__all__ = [
    "act_quant_fp8",
    "candidate_blocks",
    "engram_gate",
    "fake_quant_fp4_e4m3_scale",
    "fake_quant_fp4_ue8m0",
    "fake_quant_fp8_ue8m0",
    "fp8_gemm",
    "fp8_linear",
    "hc_mixes",
    "hc_post",
    "hc_pre",
    "hc_split_sinkhorn",
    "index_topk",
    "indexer_scores",
    "moe_experts",
    "moe_fragment_order_pays",
    "moe_gate",
    "rms_norm",
    "rope",
    "sparse_sink_attention",
]
