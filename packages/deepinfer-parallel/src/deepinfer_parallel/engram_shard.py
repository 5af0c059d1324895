"""Engram tables split by rows over an Engram group, and lookups gathered by hashed row id.

V4.1's two Engram tables have ~384 M rows each (~94 GiB of FP8 + scales): each of the G ranks of
an Engram group holds a contiguous range of rows (`RowShard`, from `layout.engram_row_range`).
A lookup (`ShardedRows.lookup`) takes this rank's hashed row ids, padded to the step's agreed
count so every rank sends the same size, all-gathers the group's ids, fills in the rows it owns
(raw bytes: FP8 values and scale bytes), and reduce-scatters the bytes back by summing: every
row has exactly one owner and the others contribute zero bytes, so each rank receives exactly
the bytes its own table would hold (the lookup is bitwise the unsharded one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm_stats import CommStats
from .layout import engram_row_range


@dataclass(frozen=True)
class RowShard:
    """Rows ``[lo, hi)`` of a table of `num_rows` rows: part `part` of `parts`."""

    num_rows: int
    parts: int
    part: int

    @property
    def lo(self) -> int:
        return engram_row_range(self.num_rows, self.parts, self.part)[0]

    @property
    def hi(self) -> int:
        return engram_row_range(self.num_rows, self.parts, self.part)[1]

    @property
    def num_local(self) -> int:
        return self.hi - self.lo


RowBytes = Callable[[torch.Tensor], torch.Tensor]
"""local_rows(local ids [M] int64) -> uint8 [M, B]: the raw bytes of the rows this rank holds."""


@dataclass
class ShardedRows:
    """Lookups of one row-sharded table over `group` (this rank holds `shard`)."""

    group: dist.ProcessGroup
    shard: RowShard
    stats: CommStats = field(default_factory=CommStats)

    def lookup(
        self, ids: torch.Tensor, local_rows: RowBytes, row_bytes: int, padded: int
    ) -> torch.Tensor:
        """ids [N] int64 global row ids (all in [0, num_rows)) -> uint8 [N, row_bytes], the
        bytes of those rows. `padded` >= N: the step's agreed id count, the same on every rank
        of the group (it sizes the collectives)."""
        n = ids.shape[0]
        if padded < n:
            raise ValueError(f"engram lookup: padded={padded} < this rank's {n} ids")
        g = self.shard.parts
        mine = torch.nn.functional.pad(ids.to(torch.int64), (0, padded - n), value=-1)
        every = mine.new_empty(g * padded)
        with self.stats.timed():
            dist.all_gather_single(every, mine, group=self.group)
        lo, hi = self.shard.lo, self.shard.hi
        owned = (every >= lo) & (every < hi)
        # fixed sizes, no host read: look every id up clamped into range, zero the foreign ones
        local = (every - lo).clamp(0, max(hi - lo - 1, 0))
        if hi > lo:
            found = local_rows(local) * owned.unsqueeze(1).to(torch.uint8)
        else:
            found = torch.zeros(g * padded, row_bytes, dtype=torch.uint8, device=ids.device)
        back = found.new_empty(padded, row_bytes)
        with self.stats.timed():
            dist.reduce_scatter_single(back, found, group=self.group)
        return back[:n]
