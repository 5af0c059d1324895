"""Print how well EPLB balances a skewed (Zipf) expert load, before and after rebalancing.

For 384 logical experts spread over 8, 16 and 64 GPUs with 0, 32 and 64 redundant slots, prints
the busiest GPU's load over the mean GPU load (1.00 = perfect) for the identity placement
(expert e on GPU e // (384 / gpus)) and for EPLB's global and hierarchical policies (expected
load, each expert's tokens split evenly over its replicas), plus "routed": the global placement
with real token-to-replica routing (``select_replicas``, batch-invariant hash of request id and
position) of tokens drawn from the load. Each layer's
load is Zipf over the experts (load of the r-th most popular expert ~ 1 / r**s) with the ranks
shuffled per layer, so hot experts are scattered the way real routers scatter them. Values are the
mean over layers. Runs on CPU in seconds:

    uv run --frozen python tools/eplb_report.py [--zipf-s 1.0] [--layers 8] [--seed 0]
"""

from __future__ import annotations

import argparse

import harness
import torch
from deepinfer_parallel.eplb import identity_gpu_load, rebalance_experts, select_replicas
from harness import Col

NUM_EXPERTS = 384
GPU_COUNTS = (8, 16, 64)
REDUNDANT = (0, 32, 64)
GPUS_PER_NODE = 8
NUM_GROUPS = 8  # expert groups for the hierarchical policy (384 / 8 = 48 experts per group)


def zipf_load(num_layers: int, num_experts: int, s: float, seed: int) -> torch.Tensor:
    """``[num_layers, num_experts]`` float64 Zipf loads, ranks shuffled per layer."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s
    base = base / base.sum() * 1e6  # tokens per layer
    return torch.stack([base[torch.randperm(num_experts, generator=g)] for _ in range(num_layers)])


def imbalance(gpu_load: torch.Tensor) -> float:
    """Mean over layers of (max GPU load / mean GPU load) for ``gpu_load [layers, gpus]``."""
    return float((gpu_load.max(dim=1).values / gpu_load.mean(dim=1)).mean())


def routed_imbalance(load: torch.Tensor, placement, num_tokens: int, seed: int) -> float:
    """Mean over layers of max/mean GPU token count when ``num_tokens`` tokens drawn from
    ``load`` are routed to replicas with the batch-invariant hash (1 expert per token draw)."""
    g = torch.Generator().manual_seed(seed + 1)
    ratios = []
    for layer in range(load.shape[0]):
        topk = torch.multinomial(load[layer], num_tokens, replacement=True, generator=g)[:, None]
        slots = select_replicas(
            topk,
            placement.log2phy[layer],
            placement.logcnt[layer],
            batch_invariant=True,
            request_ids=torch.arange(num_tokens) // 256,
            positions=torch.arange(num_tokens) % 256,
        )
        per_gpu = torch.bincount(
            slots[:, 0] // placement.slots_per_gpu, minlength=placement.num_gpus
        ).double()
        ratios.append(float(per_gpu.max() / per_gpu.mean()))
    return sum(ratios) / len(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    parser.add_argument("--layers", type=int, default=8, help="MoE layers to average over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=65_536, help="routed token draws per layer")
    args = parser.parse_args()

    table = harness.Table(
        "eplb_report",
        [
            Col("gpus", "gpus", "d"),
            Col("redundant", "redundant", "d"),
            Col("slots", "slots", "d"),
            Col("identity", "identity", ".2f"),
            Col("global", "global", ".2f"),
            Col("hier", "hierarchical", ".2f"),
            Col("routed", "routed", ".2f"),
            Col("n/a because", "why"),
        ],
        title=(
            f"EPLB balance, {NUM_EXPERTS} experts, Zipf s={args.zipf_s}, {args.layers} layers, "
            f"max/mean GPU load (1.00 = perfect); hierarchical: {NUM_GROUPS} groups, "
            f"{GPUS_PER_NODE} GPUs/node"
        ),
    )
    harness.run(table, lambda rows: measure(rows, args))


def measure(rows: list[dict], args) -> None:
    """One row per (GPU count, redundant slots)."""
    load = zipf_load(args.layers, NUM_EXPERTS, args.zipf_s, args.seed)
    for gpus in GPU_COUNTS:
        before = imbalance(identity_gpu_load(load, gpus))
        nodes = max(1, gpus // GPUS_PER_NODE)
        for redundant in REDUNDANT:
            slots = NUM_EXPERTS + redundant
            row = dict(gpus=gpus, redundant=redundant, slots=slots, identity=before)
            placements = []
            for policy in ("global", "hierarchical"):
                try:
                    p = rebalance_experts(load, slots, NUM_GROUPS, nodes, gpus, policy)
                    row[policy] = imbalance(p.gpu_load(load))
                    placements.append(p)
                except ValueError as err:  # this policy cannot place these slots: say why
                    row["why"] = str(err).split(" so that")[0]
            if placements:
                row["routed"] = routed_imbalance(load, placements[0], args.tokens, args.seed)
            rows.append(row)


if __name__ == "__main__":
    main()
