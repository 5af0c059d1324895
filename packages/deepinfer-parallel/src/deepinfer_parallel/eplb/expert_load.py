"""Expert load statistics: per layer, per logical expert token counts over a sliding window.

The MoE router (or the EP dispatch) reports, once per engine step, how many tokens each logical
expert of each MoE layer received. EPLB rebalances on the sum over the last ``window_size`` steps,
so a burst of one kind of prompt does not dominate and old traffic ages out.
"""

from __future__ import annotations

import torch


def count_expert_tokens(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token counts per expert for one layer of one step.

    Args:
        topk_ids: ``[num_tokens, top_k]`` integer expert ids chosen by the router, each in
            ``[0, num_experts)``.
        num_experts: number of experts (logical or physical, whichever the ids index).

    Returns:
        ``[num_experts]`` int64 counts (a token routed to k experts counts once for each).
    """
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got dtype {topk_ids.dtype}")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be > 0, got {num_experts}")
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.numel():
        lo, hi = torch.stack(torch.aminmax(flat)).tolist()  # one host read, not two
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must lie in [0, {num_experts}), got range [{lo}, {hi}]")
    return torch.bincount(flat, minlength=num_experts)


def logical_load_from_physical(
    physical_load: torch.Tensor, phy2log: torch.Tensor, num_logical_experts: int
) -> torch.Tensor:
    """Fold per-physical-slot counts back onto logical experts (sum over each expert's replicas).

    Args:
        physical_load: ``[layers, physical]`` counts per physical slot (what a router that
            counts after replica selection records).
        phy2log: ``[layers, physical]`` int64 logical expert held by each slot.
        num_logical_experts: number of logical experts per layer.

    Returns:
        ``[layers, num_logical_experts]`` loads, same dtype as ``physical_load``.
    """
    if physical_load.shape != phy2log.shape or physical_load.dim() != 2:
        raise ValueError(
            "physical_load and phy2log must both be [layers, physical], got "
            f"{tuple(physical_load.shape)} and {tuple(phy2log.shape)}"
        )
    out = torch.zeros(
        physical_load.shape[0],
        num_logical_experts,
        dtype=physical_load.dtype,
        device=physical_load.device,
    )
    return out.scatter_add_(1, phy2log.to(torch.int64), physical_load)


class ExpertLoadWindow:
    """Token counts per (layer, logical expert) over the last ``window_size`` recorded steps.

    A ring buffer ``[window_size, layers, logical]`` of int64 counts: :meth:`record` overwrites the
    oldest step, :meth:`load` sums the buffer. Lives on whatever device the counts come from, so a
    GPU router can record without a host sync.
    """

    def __init__(
        self,
        num_layers: int,
        num_logical_experts: int,
        window_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_logical_experts", num_logical_experts),
            ("window_size", window_size),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_logical_experts = num_logical_experts
        self.window_size = window_size
        # [window_size, layers, logical]: one row of counts per recorded step.
        self._buffer = torch.zeros(
            window_size, num_layers, num_logical_experts, dtype=torch.int64, device=device
        )
        self._next = 0  # ring slot the next step writes
        self.steps_recorded = 0  # total steps ever recorded (not capped by the window)

    def record(self, step_counts: torch.Tensor) -> None:
        """Add one step's counts ``[layers, logical]`` (integer), evicting the oldest step."""
        expected = (self.num_layers, self.num_logical_experts)
        if tuple(step_counts.shape) != expected:
            raise ValueError(
                f"step_counts must have shape [layers, logical] = {list(expected)}, "
                f"got {list(step_counts.shape)}"
            )
        if step_counts.dtype.is_floating_point:
            raise ValueError(f"step_counts must be integer counts, got dtype {step_counts.dtype}")
        self._buffer[self._next].copy_(step_counts)
        self._next = (self._next + 1) % self.window_size
        self.steps_recorded += 1

    def load(self) -> torch.Tensor:
        """``[layers, logical]`` int64 token counts summed over the window (fewer early on)."""
        return self._buffer.sum(dim=0)

    @property
    def steps_in_window(self) -> int:
        """How many of the window's steps hold real data (< window_size until it has filled)."""
        return min(self.steps_recorded, self.window_size)

    def reset(self) -> None:
        """Forget all recorded steps (e.g. after the experts were rearranged)."""
        self._buffer.zero_()
        self._next = 0
        self.steps_recorded = 0
