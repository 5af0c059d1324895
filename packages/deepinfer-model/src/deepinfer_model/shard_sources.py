"""Where a sharded model's tensors are in the full checkpoint: what `Model.shard_sources` plans
and `loader.load_model` reads (a rank reads only these)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorSource:
    """Where a model tensor's bytes are in the checkpoint: tensor `name`, whole, or its rows
    ``[lo, hi)`` along dim 0 (`rows`)."""

    name: str
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class ShardSources:
    """What a sharded model loads: `sources` for the tensors whose checkpoint tensor differs
    from their own name or is a row range (the others load by name); `elsewhere`: checkpoint
    tensors that other ranks hold, which this load leaves unread."""

    sources: dict[str, TensorSource] = field(default_factory=dict)
    elsewhere: frozenset[str] = frozenset()
