"""The expert dispatch backends by name: what `expert_parallel_size > 1` runs its MoE layers'
dispatch and combine with (`EngineConfig.expert_dispatch`)."""

from __future__ import annotations

import torch.distributed as dist

from .expert_dispatch import AllGatherDispatch, AllToAllDispatch, ExpertDispatch, ExpertShard

DISPATCH_BACKENDS = ("allgather", "alltoall", "deep_ep")


def make_dispatch(
    name: str, group: dist.ProcessGroup, shard: ExpertShard, hidden_size: int
) -> ExpertDispatch:
    """The backend called `name` (one of `DISPATCH_BACKENDS`) over `group`; "deep_ep" needs the
    `deep_ep` library and CUDA (`DeepEPDispatch`)."""
    if name == "allgather":
        return AllGatherDispatch(group, shard)
    if name == "alltoall":
        return AllToAllDispatch(group, shard)
    if name == "deep_ep":
        from .deep_ep_dispatch import DeepEPDispatch

        return DeepEPDispatch(group, shard, hidden_size=hidden_size)
    raise ValueError(f"expert dispatch {name!r} is not one of {', '.join(DISPATCH_BACKENDS)}")
