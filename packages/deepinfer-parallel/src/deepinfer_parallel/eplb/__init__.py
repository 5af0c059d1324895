"""EPLB: expert load statistics, the rebalancing algorithm, and routing through the placement."""

from .expert_load import ExpertLoadWindow, count_expert_tokens, logical_load_from_physical
from .moves import exchange_experts, plan_moves
from .online import OnlineEPLB
from .rebalance import (
    POLICIES,
    ExpertPlacement,
    balanced_packing,
    identity_gpu_load,
    initial_placement,
    placement_gpu_load,
    rebalance_experts,
    replicate_experts,
)
from .routing import select_replicas, token_hash

__all__ = [
    "POLICIES",
    "ExpertLoadWindow",
    "ExpertPlacement",
    "OnlineEPLB",
    "balanced_packing",
    "count_expert_tokens",
    "exchange_experts",
    "identity_gpu_load",
    "initial_placement",
    "logical_load_from_physical",
    "placement_gpu_load",
    "plan_moves",
    "rebalance_experts",
    "replicate_experts",
    "select_replicas",
    "token_hash",
]
