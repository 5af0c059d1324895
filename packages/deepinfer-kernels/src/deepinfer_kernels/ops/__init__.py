"""The public op functions. Each topic module declares its ops and registers their tiers.

Call these (never a tier directly): ``from deepinfer_kernels import ops; ops.rms_norm(x, w, eps)``.
"""

# model-helper topics (norm, rope, attention, indexer, mhc, engram)
from .attention import sparse_sink_attention
from .engram import engram_gate
from .indexer import candidate_blocks, index_topk, indexer_scores
from .mhc import hc_mixes, hc_post, hc_pre, hc_split_sinkhorn
from .norm import rms_norm
from .rope import rope

# kernels helper: quantisation, dense FP8 linear, MoE
from .linear import fp8_gemm, fp8_linear
from .moe import moe_experts, moe_gate
from .quant import act_quant_fp8, rms_norm_act_quant_fp8, swiglu_act_quant_fp8
