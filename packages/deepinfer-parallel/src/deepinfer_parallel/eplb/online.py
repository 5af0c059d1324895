"""EPLB online: count the router's choices, rebalance every `interval` steps, adopt the result.

`OnlineEPLB` is one rank's bookkeeping for all MoE layers of its EP group:
* `record(layer, logical_ids)` adds a forward's router choices (its real tokens, never padding)
  to the current step's counts, on the ids' device (no host sync);
* `end_step(group)` closes the step: its counts go into the sliding window
  (`ExpertLoadWindow`, `window_size` steps), and every `interval` steps the window's load,
  summed over all ranks of `group`, is rebalanced (`rebalance_experts`, global policy) into a
  new placement, which it returns for the caller to move the weights and `adopt` it.
Every rank steps in lockstep (the engine's step agreement), so all rebalance at the same step
and, from the same summed load, compute the same placement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .expert_load import ExpertLoadWindow
from .rebalance import ExpertPlacement, rebalance_experts


class OnlineEPLB:
    """See the module docstring. `placement`: the current one (all layers)."""

    def __init__(
        self,
        placement: ExpertPlacement,
        window_size: int,
        interval: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if interval < 1:
            raise ValueError(f"OnlineEPLB: interval={interval} must be >= 1 (0 means no EPLB)")
        self.placement = placement
        self.interval = interval
        self.window = ExpertLoadWindow(
            placement.num_layers, placement.num_logical, window_size, device
        )
        self._counts = torch.zeros(
            placement.num_layers, placement.num_logical, dtype=torch.int64, device=device
        )
        self.steps = 0
        self.rebalances = 0

    def record(
        self, layer: int, logical_ids: torch.Tensor, valid: torch.Tensor | None = None
    ) -> None:
        """Add one forward's router choices ``[T, k]`` (logical ids) of MoE layer `layer`;
        with `valid` (a device scalar) only its first `valid` rows count (the others pad a
        static buffer), still without a host read."""
        t, k = logical_ids.shape
        flat = logical_ids.reshape(-1).to(torch.int64)
        ones = torch.ones_like(flat)
        if valid is not None:
            real = torch.arange(t, device=flat.device) < valid
            ones = real.repeat_interleave(k).to(torch.int64)
        self._counts[layer].index_add_(0, flat, ones)

    def end_step(self, group: dist.ProcessGroup | None) -> ExpertPlacement | None:
        """Close one engine step; every `interval` steps return the rebalanced placement."""
        self.window.record(self._counts)
        self._counts.zero_()
        self.steps += 1
        if self.steps % self.interval:
            return None
        load = self.window.load().cpu()
        if group is not None:
            dist.all_reduce(load, group=group)
        p = self.placement
        return rebalance_experts(load, p.num_physical, num_gpus=p.num_gpus, policy="global")

    def adopt(self, placement: ExpertPlacement) -> None:
        """The weights now follow `placement`. The window keeps its counts: they are per
        logical expert, whatever the placement."""
        self.placement = placement
        self.rebalances += 1
