"""How the ranks of one engine split the work: attention DP, MoE EP and Engram row sharding.

The engine runs ``world_size = max(D, E, G)`` ranks (one process, one device each), where D =
`data_parallel_size`, E = `expert_parallel_size`, G = `engram_parallel_size`, and each of the
three divides the world:

* **DP.** Ranks ``d * W/D .. (d+1) * W/D - 1`` form DP rank ``d``: they hold the same requests,
  scheduler and KV cache (its *replicas*; with D = W every rank is a DP rank of its own). The
  first replica (the DP leader) reports outputs; the others follow its sampled tokens.
* **EP.** Contiguous blocks of E ranks form the EP groups; each holds every expert once, split
  into E equal parts of ``(num_experts + extra) / E`` physical slots (slot ``p`` of a group on
  its member ``p // slots_per_rank``).
* **Engram.** Contiguous blocks of G ranks form the Engram groups; each holds both Engram tables
  once, split by rows into G near-equal ranges (`engram_row_range`).

A layout that cannot be built raises `LayoutError` naming the numbers, before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot be built (names the sizes that disagree)."""


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits: its DP rank and replica index, its EP group and rank in it, its
    Engram group and rank in it."""

    rank: int
    dp_rank: int
    dp_replica: int
    ep_group: int
    ep_rank: int
    engram_group: int
    engram_rank: int

    @property
    def is_dp_leader(self) -> bool:
        return self.dp_replica == 0


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name}={value!r} must be an integer >= 1")
    return value


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel sizes of one engine (see the module docstring); validated on creation."""

    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    engram_parallel_size: int = 1

    def __post_init__(self) -> None:
        d = _positive_int("data_parallel_size", self.data_parallel_size)
        e = _positive_int("expert_parallel_size", self.expert_parallel_size)
        g = _positive_int("engram_parallel_size", self.engram_parallel_size)
        w = max(d, e, g)
        bad = [f"{name}={v}" for name, v in (("data", d), ("expert", e), ("engram", g)) if w % v]
        if bad:
            raise LayoutError(
                f"parallel sizes data={d}, expert={e}, engram={g} need {w} ranks (the largest), "
                f"and each size must divide it; {', '.join(bad)} does not divide {w}"
            )

    @property
    def world_size(self) -> int:
        return max(self.data_parallel_size, self.expert_parallel_size, self.engram_parallel_size)

    @property
    def replicas_per_dp_rank(self) -> int:
        return self.world_size // self.data_parallel_size

    def check(
        self,
        *,
        num_experts: int | None = None,
        extra_experts: int = 0,
        num_devices: int | None = None,
    ) -> None:
        """Raise `LayoutError` if the model or the machine cannot take this layout.

        num_experts: routed experts per MoE layer; with `extra_experts` redundant slots the
        ``num_experts + extra_experts`` physical slots must split evenly over E ranks.
        num_devices: accelerators available (None: not limited, e.g. CPU processes).
        """
        e = self.expert_parallel_size
        if isinstance(extra_experts, bool) or not isinstance(extra_experts, int):
            raise LayoutError(f"extra experts={extra_experts!r} must be an integer >= 0")
        if extra_experts < 0:
            raise LayoutError(f"extra experts={extra_experts} must be >= 0")
        if num_experts is not None:
            slots = num_experts + extra_experts
            if slots % e:
                raise LayoutError(
                    f"{num_experts} routed experts + {extra_experts} redundant slots = {slots} "
                    f"physical slots do not split evenly over expert_parallel_size={e} ranks"
                )
            if extra_experts and e == 1:
                raise LayoutError(
                    f"{extra_experts} redundant expert slots need expert_parallel_size > 1 "
                    "(one rank already holds every expert)"
                )
        if num_devices is not None and self.world_size > num_devices:
            raise LayoutError(
                f"parallel sizes data={self.data_parallel_size}, expert={e}, "
                f"engram={self.engram_parallel_size} need {self.world_size} ranks, one device "
                f"each, but only {num_devices} devices are visible"
            )

    def coords(self, rank: int) -> RankCoords:
        """The coordinates of `rank` in [0, world_size)."""
        w = self.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < w:
            raise LayoutError(f"rank={rank!r} must be in [0, {w})")
        rep = self.replicas_per_dp_rank
        e, g = self.expert_parallel_size, self.engram_parallel_size
        return RankCoords(rank, rank // rep, rank % rep, rank // e, rank % e, rank // g, rank % g)

    def dp_replica_groups(self) -> list[list[int]]:
        """The ranks of each DP rank (leader first)."""
        rep = self.replicas_per_dp_rank
        return [list(range(d * rep, (d + 1) * rep)) for d in range(self.data_parallel_size)]

    def ep_groups(self) -> list[list[int]]:
        e = self.expert_parallel_size
        return [list(range(s, s + e)) for s in range(0, self.world_size, e)]

    def engram_groups(self) -> list[list[int]]:
        g = self.engram_parallel_size
        return [list(range(s, s + g)) for s in range(0, self.world_size, g)]

    def dp_leaders(self) -> list[int]:
        """The reporting rank of each DP rank."""
        return [ranks[0] for ranks in self.dp_replica_groups()]


def engram_row_range(num_rows: int, parts: int, part: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a table of `num_rows` rows that part `part` of `parts` holds: the
    first ``num_rows % parts`` parts hold one row more, so every row has exactly one owner."""
    if parts < 1 or not 0 <= part < parts:
        raise LayoutError(f"engram part {part} must be in [0, {parts})")
    base, rem = divmod(num_rows, parts)
    lo = part * base + min(part, rem)
    return lo, lo + base + (1 if part < rem else 0)
