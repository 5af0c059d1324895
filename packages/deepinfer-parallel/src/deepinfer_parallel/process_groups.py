"""The process groups of one rank under a `ParallelLayout` (after `rendezvous.init_rank`).

* `control`: every rank, on gloo over CPU tensors: the per-step agreement (`StepSync`) and the
  EPLB load sums, so host decisions never wait on the device's stream.
* `ep`: this rank's EP group on the device backend (MoE dispatch/combine, expert moves); None
  when E = 1.
* `engram`: this rank's Engram group on the device backend (sharded table lookups); None when
  G = 1.
* `replicas`: the ranks of this rank's DP rank (the leader broadcasts its sampled tokens);
  None when every rank is a DP rank of its own.

`torch.distributed.new_group` must be called by every rank for every group, in the same order,
members or not: `RankGroups.create` does exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .layout import ParallelLayout, RankCoords


@dataclass
class RankGroups:
    """This rank's groups (see the module docstring) and its coordinates."""

    layout: ParallelLayout
    coords: RankCoords
    control: dist.ProcessGroup
    ep: dist.ProcessGroup | None
    engram: dist.ProcessGroup | None
    replicas: dist.ProcessGroup | None

    @classmethod
    def create(cls, layout: ParallelLayout) -> RankGroups:
        """Build the groups of the calling rank (the default group must be initialised with
        ``world_size == layout.world_size``)."""
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(
                f"the process group has {world} ranks but the layout (data="
                f"{layout.data_parallel_size}, expert={layout.expert_parallel_size}, engram="
                f"{layout.engram_parallel_size}) needs {layout.world_size}"
            )
        rank = dist.get_rank()
        default = dist.group.WORLD
        device_backend = dist.get_backend()
        control = default if device_backend == "gloo" else dist.new_group(backend="gloo")

        def mine(blocks: list[list[int]]) -> dist.ProcessGroup | None:
            if len(blocks[0]) == 1:
                return None
            if len(blocks) == 1:
                return default
            own = None
            for ranks in blocks:
                group = dist.new_group(ranks)
                if rank in ranks:
                    own = group
            return own

        return cls(
            layout=layout,
            coords=layout.coords(rank),
            control=control,
            ep=mine(layout.ep_groups()),
            engram=mine(layout.engram_groups()),
            replicas=mine(layout.dp_replica_groups()),
        )

    @property
    def rank(self) -> int:
        return self.coords.rank
