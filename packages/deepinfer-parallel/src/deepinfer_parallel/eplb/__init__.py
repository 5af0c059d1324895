"""EPLB: expert load statistics, the rebalancing algorithm, and routing through the placement."""

from .expert_load import ExpertLoadWindow, count_expert_tokens, logical_load_from_physical
from .rebalance import (
    POLICIES,
    ExpertPlacement,
    balanced_packing,
    identity_gpu_load,
    placement_gpu_load,
    rebalance_experts,
    replicate_experts,
)
from .routing import select_replicas, token_hash

__all__ = [
    "POLICIES",
    "ExpertLoadWindow",
    "ExpertPlacement",
    "balanced_packing",
    "count_expert_tokens",
    "identity_gpu_load",
    "logical_load_from_physical",
    "placement_gpu_load",
    "rebalance_experts",
    "replicate_experts",
    "select_replicas",
    "token_hash",
]
