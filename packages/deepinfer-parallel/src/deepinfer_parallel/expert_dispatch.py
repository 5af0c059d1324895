"""MoE expert parallelism: send each token to the ranks holding its experts, bring the outputs back.

Every rank of an EP group of E ranks holds `slots_per_rank` consecutive physical expert slots
(`ExpertShard`); a token routed to physical slot ``p`` needs rank ``p // slots_per_rank``. A
backend's `routed(x, weights, slots, logical, compute, rows)` runs one MoE layer's routed experts
over the group: it moves the tokens, has `compute` (the rank's grouped expert kernel, e.g.
`ops.moe_experts` over its local stacks) evaluate them, and returns each token's weighted sum.
Every rank of the group must call it for every MoE layer, in order, also with no tokens.

Two backends, both on gloo and NCCL:
* `AllGatherDispatch` (the default): all-gather the group's tokens (each rank padded to the
  step's agreed `rows`, so every rank sends the same size), compute the local experts on all of
  them, reduce-scatter the partial sums back. Fixed sizes: no host sync, fits CUDA graphs.
* `AllToAllDispatch`: `all_to_all_single` with per-rank counts: each token goes once to each
  rank that holds one of its experts and comes back as that rank's partial sum. Less traffic,
  but the counts are exchanged and read on the host (a sync per layer on a GPU).

Exact mode (`routed(..., exact=True)`, batch-invariant engines): each (token, expert) pair
travels and comes back on its own, and the home rank adds a token's expert outputs in fp32 in
ascending logical expert order (`sum_in_expert_order`), the order of the single-rank reference
kernel; with `compute` evaluating each row independently the result is then bitwise the
single-rank one. It moves top_k times the combine bytes, so it is for batch-invariant runs only.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from .comm_stats import CommStats

ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""compute(x [M, D], weights [M, k] fp32, local_ids [M, k] int64, -1 = skip) -> [M, D] x.dtype:
the rank's local experts on M rows, each row's weighted sum over its non-negative ids."""


@dataclass(frozen=True)
class ExpertShard:
    """Rank `ep_rank` of an EP group of `ep_size` holds physical slots
    ``[ep_rank * slots_per_rank, (ep_rank + 1) * slots_per_rank)``."""

    ep_rank: int
    ep_size: int
    slots_per_rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.ep_rank < self.ep_size or self.slots_per_rank < 1:
            raise ValueError(
                f"ExpertShard: ep_rank={self.ep_rank} must be in [0, {self.ep_size}) and "
                f"slots_per_rank={self.slots_per_rank} >= 1"
            )

    @property
    def first_slot(self) -> int:
        return self.ep_rank * self.slots_per_rank

    @property
    def num_physical(self) -> int:
        return self.ep_size * self.slots_per_rank

    def local_ids(self, slots: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Physical slot ids [...] -> local slot ids on `rank` (default: this one), -1 where
        the slot lives elsewhere (or is already -1)."""
        first = (self.ep_rank if rank is None else rank) * self.slots_per_rank
        local = slots - first
        here = (slots >= first) & (local < self.slots_per_rank) & (slots >= 0)
        return torch.where(here, local, torch.full_like(local, -1))

    def rank_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The group rank holding each physical slot id [...]."""
        return torch.div(slots, self.slots_per_rank, rounding_mode="floor")


def sum_in_expert_order(per_slot: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
    """per_slot [T, k, D] (each expert's weighted output), logical [T, k] distinct ids per row
    -> [T, D] fp32: ``0 + y_a + y_b + ...`` in ascending logical id, one fp32 add at a time (the
    single-rank reference's order, so the sum is bitwise the same)."""
    t, k, d = per_slot.shape
    order = logical.argsort(dim=1)
    ordered = per_slot.gather(1, order.unsqueeze(-1).expand(t, k, d))
    acc = torch.zeros(t, d, dtype=torch.float32, device=per_slot.device)
    for j in range(k):
        acc = acc + ordered[:, j].float()
    return acc


# ---- packing rows of several tensors into one byte buffer (one collective instead of three) ---
@dataclass(frozen=True)
class _Field:
    dtype: torch.dtype
    shape: tuple[int, ...]  # per row

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def _pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[_Field]]:
    """[R, ...] tensors -> (uint8 [R, sum of row bytes], their layouts)."""
    rows = tensors[0].shape[0]
    fields = [_Field(t.dtype, tuple(t.shape[1:])) for t in tensors]
    parts = [
        t.contiguous().view(torch.uint8).reshape(rows, f.nbytes)
        for t, f in zip(tensors, fields, strict=True)
    ]
    return torch.cat(parts, dim=1), fields


def _unpack(buf: torch.Tensor, fields: list[_Field]) -> list[torch.Tensor]:
    rows, out, o = buf.shape[0], [], 0
    for f in fields:
        raw = buf.new_empty(rows, f.nbytes)
        raw.copy_(buf[:, o : o + f.nbytes])  # a fresh buffer: aligned for any dtype view
        out.append(raw.view(f.dtype).reshape(rows, *f.shape))
        o += f.nbytes
    return out


@dataclass(frozen=True)
class RoutedCall:
    """One MoE layer's call of a backend: x [T, D], weights [T, k] fp32, slots [T, k] int64
    physical slot ids, logical [T, k] their logical experts, the rank's `compute`, the step's
    agreed `rows` (>= T, the same on every rank of the group), `exact` (batch-invariant order)."""

    x: torch.Tensor
    weights: torch.Tensor
    slots: torch.Tensor
    logical: torch.Tensor
    compute: ExpertCompute
    rows: int
    exact: bool


@dataclass
class ExpertDispatch(abc.ABC):
    """One MoE layer's routed experts over the EP `group` (see the module docstring): the
    backends implement `_routed`."""

    group: dist.ProcessGroup | None
    shard: ExpertShard
    stats: CommStats = field(default_factory=CommStats)
    name: ClassVar[str] = ""
    graphable: ClassVar[bool] = False
    """Runs inside a captured CUDA graph: fixed sizes, no host read."""

    def routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        slots: torch.Tensor,
        logical: torch.Tensor,
        compute: ExpertCompute,
        rows: int,
        exact: bool = False,
    ) -> torch.Tensor:
        """x [T, D], weights [T, k] fp32, slots [T, k] physical slot ids, logical [T, k] their
        logical experts -> [T, D] x.dtype, the routed experts' weighted sum. `rows` >= T is the
        step's agreed row count (the same on every rank of the group); `exact`: the
        batch-invariant order (module docstring)."""
        if rows < x.shape[0]:
            raise ValueError(
                f"expert dispatch: rows={rows} (the step's agreed count) < this rank's "
                f"{x.shape[0]} tokens"
            )
        call = RoutedCall(x, weights.float(), slots.to(torch.int64), logical, compute, rows, exact)
        return self._routed(call)

    @abc.abstractmethod
    def _routed(self, call: RoutedCall) -> torch.Tensor: ...


@dataclass
class AllGatherDispatch(ExpertDispatch):
    """All-gather + reduce-scatter (the default backend; see the module docstring)."""

    name: ClassVar[str] = "allgather"
    graphable: ClassVar[bool] = True

    def _routed(self, call: RoutedCall) -> torch.Tensor:
        x, slots = call.x, call.slots
        t, k = slots.shape
        d = x.shape[1]
        e = self.shard.ep_size
        pad = call.rows - t
        rows = call.rows
        xp = torch.nn.functional.pad(x, (0, 0, 0, pad))
        wp = torch.nn.functional.pad(call.weights, (0, 0, 0, pad))
        sp = torch.nn.functional.pad(slots, (0, 0, 0, pad), value=-1)
        buf, fields = _pack([xp, wp, sp])
        gathered = buf.new_empty(e * rows, buf.shape[1])
        with self.stats.timed():
            dist.all_gather_single(gathered, buf, group=self.group)
        xg, wg, sg = _unpack(gathered, fields)
        local = self.shard.local_ids(sg)
        if not call.exact:
            y = call.compute(xg, wg, local)
            out = y.new_empty(rows, d)
            with self.stats.timed():
                dist.reduce_scatter_single(out, y, group=self.group)
            return out[:t]
        per_slot = torch.stack(
            [call.compute(xg, wg[:, j : j + 1], local[:, j : j + 1]) for j in range(k)], dim=1
        )  # [E * rows, k, D]: each (token, slot) non-zero on exactly one rank
        mine = per_slot.new_empty(rows, k, d)
        with self.stats.timed():
            dist.reduce_scatter_single(mine, per_slot, group=self.group)
        return sum_in_expert_order(mine[:t], call.logical).to(x.dtype)


@dataclass
class AllToAllDispatch(ExpertDispatch):
    """`all_to_all_single` with per-rank counts (see the module docstring)."""

    name: ClassVar[str] = "alltoall"

    def _exchange(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list]:
        """Rows of `send` (grouped by destination, `send_counts` each) -> (received rows,
        received counts per source)."""
        counts = torch.tensor(send_counts, dtype=torch.int64).to(send.device)
        recv_counts_t = torch.empty_like(counts)
        with self.stats.timed():
            dist.all_to_all_single(recv_counts_t, counts, group=self.group)
        recv_counts = recv_counts_t.tolist()  # the next call's splits: a host read
        recv = send.new_empty(sum(recv_counts), *send.shape[1:])
        with self.stats.timed():
            dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group)
        return recv, recv_counts

    def _routed(self, call: RoutedCall) -> torch.Tensor:
        x, slots, weights = call.x, call.slots, call.weights
        t, k = slots.shape
        d = x.shape[1]
        e = self.shard.ep_size
        dest = self.shard.rank_of(slots)  # [T, k]
        if call.exact:
            # one row per (token, slot), ordered by destination rank, then token, then slot
            flat_dest = dest.reshape(-1)
            key = flat_dest * (t * k) + torch.arange(t * k, device=x.device)
            order = torch.argsort(key)  # keys are distinct: the order is unique
            tok = order // k
            slot_j = order % k
            send_dest = flat_dest[order]
            send_ids = (slots.reshape(-1)[order] - send_dest * self.shard.slots_per_rank)[:, None]
            send_w = weights.reshape(-1)[order][:, None]
        else:
            on = torch.zeros(t, e, dtype=torch.bool, device=x.device)
            on.scatter_(1, dest, True)  # [T, E]: token t needs rank r
            r_idx, tok = on.t().nonzero(as_tuple=True)  # rank-major, tokens ascending
            send_dest = r_idx
            here = dest[tok] == r_idx[:, None]  # [M, k]
            local = slots[tok] - r_idx[:, None] * self.shard.slots_per_rank
            send_ids = torch.where(here, local, torch.full_like(local, -1))
            send_w = weights[tok]
        send_counts = torch.bincount(send_dest, minlength=e).tolist()
        buf, fields = _pack([x[tok], send_w, send_ids])
        recv, recv_counts = self._exchange(buf, send_counts)
        xr, wr, ir = _unpack(recv, fields)
        y = call.compute(xr, wr, ir)  # [M_recv, D]
        back = y.new_empty(len(tok), d)
        with self.stats.timed():
            dist.all_to_all_single(back, y, send_counts, recv_counts, group=self.group)
        if not call.exact:
            acc = torch.zeros(t, d, dtype=torch.float32, device=x.device)
            acc.index_add_(0, tok, back.float())
            return acc.to(x.dtype)
        per_slot = back.new_zeros(t, k, d)
        per_slot[tok, slot_j] = back
        return sum_in_expert_order(per_slot, call.logical).to(x.dtype)
