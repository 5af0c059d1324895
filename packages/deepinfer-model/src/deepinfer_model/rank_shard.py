"""One rank's part of a parallel V4.1 model (`RankShard`) and the scope of the forward in progress.

Under expert parallelism (E > 1) each backbone MoE layer holds only this rank's physical expert
slots (`ExpertParallel`: placement, routing, dispatch, online EPLB); under Engram sharding
(G > 1) each Engram table holds only this rank's rows and looks the others up over its group
(`ShardedRows`). Everything else (attention, the dense and shared experts, the router, the
DSpark stages) is replicated.

Collectives need every rank of a group to take part with the same sizes, so the model runs each
forward inside `RankShard.forward(rows, keys)`: `rows` is the step's agreed token count (the
largest over all ranks), which the layers pad their collectives to; `keys` identify this
forward's tokens for the batch-invariant replica choice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from deepinfer_parallel.dispatch_backends import make_dispatch
from deepinfer_parallel.engram_shard import RowShard, ShardedRows
from deepinfer_parallel.eplb import ExpertPlacement, OnlineEPLB, initial_placement
from deepinfer_parallel.expert_dispatch import AllGatherDispatch, ExpertShard
from deepinfer_parallel.expert_parallel import ExpertParallel
from deepinfer_parallel.layout import ParallelLayout
from deepinfer_parallel.process_groups import RankGroups

from .config import ModelConfig


@dataclass
class ForwardScope:
    """The forward in progress: `rows`, the step's agreed token count (>= this forward's);
    `keys`: (sequence key [T], position [T]) of its tokens, or None (replicas keyed by row);
    `valid`: a device scalar, the rows that are real tokens when the forward runs padded
    static buffers (a CUDA graph), None when every row is."""

    rows: int = 0
    keys: tuple[torch.Tensor, torch.Tensor] | None = None
    valid: torch.Tensor | None = None


@dataclass
class RankShard:
    """What this rank holds of the model (None: that part whole) and its forward scope."""

    experts: ExpertParallel | None = None
    engram: list[ShardedRows] | None = None
    scope: ForwardScope = field(default_factory=ForwardScope)

    @contextmanager
    def forward(
        self,
        rows: int,
        keys: tuple[torch.Tensor, torch.Tensor] | None = None,
        valid: torch.Tensor | None = None,
    ) -> Iterator[ForwardScope]:
        """Scope one forward: its collectives pad to `rows`."""
        saved = self.scope
        self.scope = ForwardScope(rows, keys, valid)
        try:
            yield self.scope
        finally:
            self.scope = saved

    @classmethod
    def build(
        cls,
        groups: RankGroups,
        config: ModelConfig,
        *,
        device: torch.device | str,
        extra_experts: int = 0,
        dispatch: str = "allgather",
        eplb_window: int = 100,
        eplb_interval: int = 0,
    ) -> RankShard:
        """This rank's shard under `groups`' layout: `extra_experts` redundant slots per MoE
        layer, the `dispatch` backend, online EPLB every `eplb_interval` steps over a window of
        `eplb_window` steps (0: off)."""
        layout, coords = groups.layout, groups.coords
        layout.check(num_experts=config.n_routed_experts, extra_experts=extra_experts)
        experts = None
        if groups.ep is not None:
            shard, placement = _expert_plan(layout, coords.ep_rank, config, extra_experts)
            eplb = None
            if eplb_interval:
                eplb = OnlineEPLB(placement, eplb_window, eplb_interval, device)
            experts = ExpertParallel(
                make_dispatch(dispatch, groups.ep, shard, config.hidden_size),
                placement,
                eplb=eplb,
                control=groups.control,
                device=device,
            )
        engram = None
        if groups.engram is not None and config.engram_layer_ids:
            engram = _engram_plan(layout, coords.engram_rank, config, groups.engram)
        return cls(experts=experts, engram=engram)

    @classmethod
    def plan(
        cls, layout: ParallelLayout, rank: int, config: ModelConfig, extra_experts: int = 0
    ) -> RankShard:
        """The shard `rank` of `layout` would hold, without process groups: to build a model
        on the meta device and count what each rank holds (its collectives cannot run)."""
        layout.check(num_experts=config.n_routed_experts, extra_experts=extra_experts)
        coords = layout.coords(rank)
        experts = engram = None
        if layout.expert_parallel_size > 1:
            shard, placement = _expert_plan(layout, coords.ep_rank, config, extra_experts)
            experts = ExpertParallel(AllGatherDispatch(None, shard), placement)
        if layout.engram_parallel_size > 1 and config.engram_layer_ids:
            engram = _engram_plan(layout, coords.engram_rank, config, None)
        return cls(experts=experts, engram=engram)


def _expert_plan(
    layout: ParallelLayout, ep_rank: int, config: ModelConfig, extra: int
) -> tuple[ExpertShard, ExpertPlacement]:
    n, e = config.n_routed_experts, layout.expert_parallel_size
    shard = ExpertShard(ep_rank, e, (n + extra) // e)
    return shard, initial_placement(config.num_hidden_layers, n, n + extra, e)


def _engram_plan(
    layout: ParallelLayout, engram_rank: int, config: ModelConfig, group
) -> list[ShardedRows]:
    g = layout.engram_parallel_size
    return [
        ShardedRows(group, RowShard(rows, g, engram_rank)) for rows in config.engram_num_embeddings
    ]
