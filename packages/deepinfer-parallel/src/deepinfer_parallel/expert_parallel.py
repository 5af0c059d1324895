"""One rank's view of expert parallelism over all MoE layers (`ExpertParallel`).

It ties together what a MoE layer needs on this rank: the placement (which logical expert each
physical slot holds, `ExpertPlacement`), routing a token's logical experts to physical slots
(`route`: the only replica when there is one, else `select_replicas`, batch-invariant when
keyed by each token's (sequence key, position)), the dispatch backend that moves tokens over
the EP group, and, when EPLB runs online, the load statistics and the rebalance schedule
(`OnlineEPLB`). Moving the expert weights after a rebalance is the model's part (it owns the
stacks): it calls `moves(layer, new)` for each layer, then `adopt(new)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .eplb.moves import plan_moves
from .eplb.online import OnlineEPLB
from .eplb.rebalance import ExpertPlacement
from .eplb.routing import select_replicas
from .expert_dispatch import ExpertDispatch


class ExpertParallel:
    """See the module docstring.

    dispatch: the backend (its `shard` says which slots this rank holds); placement: the
    starting placement (`initial_placement`), ``num_gpus`` = the EP size; eplb: online
    rebalancing (None: the placement stays); control: the CPU group over which EPLB sums the
    ranks' loads (None: one rank); device: where the routing tables live.
    """

    def __init__(
        self,
        dispatch: ExpertDispatch,
        placement: ExpertPlacement,
        *,
        eplb: OnlineEPLB | None = None,
        control: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        shard = dispatch.shard
        if placement.num_gpus != shard.ep_size or placement.num_physical != shard.num_physical:
            raise ValueError(
                f"ExpertParallel: the placement has {placement.num_physical} slots on "
                f"{placement.num_gpus} ranks but the shard {shard.num_physical} on {shard.ep_size}"
            )
        self.dispatch = dispatch
        self.eplb = eplb
        self.control = control
        self.device = torch.device(device)
        self._set(placement)

    def _set(self, placement: ExpertPlacement) -> None:
        self.placement = placement
        self._log2phy = placement.log2phy.to(self.device)
        self._logcnt = placement.logcnt.to(self.device)
        self._replicated = bool((placement.logcnt > 1).any())

    @property
    def graphable(self) -> bool:
        """The dispatch backend can run inside a captured CUDA graph (fixed sizes, no host
        reads)."""
        return self.dispatch.graphable

    @property
    def shard(self):
        return self.dispatch.shard

    @property
    def slots_per_rank(self) -> int:
        return self.shard.slots_per_rank

    def local_logical(self, layer: int) -> list[int]:
        """The logical expert in each of this rank's slots of MoE layer `layer`."""
        first = self.shard.first_slot
        return self.placement.phy2log[layer, first : first + self.slots_per_rank].tolist()

    def route(
        self,
        layer: int,
        logical: torch.Tensor,
        keys: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """logical [T, k] router ids -> physical slots [T, k]. keys: (sequence key [T],
        position [T]) makes the replica choice batch-invariant; None keys it by row."""
        if not self._replicated:
            return self._log2phy[layer, :, 0][logical]
        seq, pos = keys if keys is not None else (None, None)
        return select_replicas(
            logical,
            self._log2phy[layer],
            self._logcnt[layer],
            batch_invariant=keys is not None,
            request_ids=seq,
            positions=pos,
        )

    def record(self, layer: int, logical: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Count a forward's router choices when EPLB runs: every row, or the first `valid`
        (a device scalar: a graphed forward's real tokens)."""
        if self.eplb is not None:
            self.eplb.record(layer, logical, valid)

    def end_step(self) -> ExpertPlacement | None:
        """Close one engine step; a new placement when EPLB rebalances now."""
        if self.eplb is None:
            return None
        return self.eplb.end_step(self.control)

    def moves(self, layer: int, new: ExpertPlacement) -> list[tuple[int, int]]:
        """(source rank, source local slot) of each new slot of `layer` (for `exchange_experts`)."""
        old = self.placement.phy2log[layer].tolist()
        return plan_moves(old, new.phy2log[layer].tolist(), self.slots_per_rank)

    def adopt(self, new: ExpertPlacement) -> None:
        """The weights follow `new` now: route through it from the next forward on."""
        self._set(new)
        if self.eplb is not None:
            self.eplb.adopt(new)
