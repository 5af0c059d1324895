"""The per-step agreement of the ranks (`StepSync`): one all-reduce of four integers.

Every rank schedules its own requests (attention DP), but the MoE and Engram collectives of a
step need every rank to run the same number of forwards over the same padded row count, and
the same kind of step (a CUDA-graphed decode on every rank, or an eager step with prefill on
every rank). So after scheduling, each rank states its `StepDemand` and all get the same
`StepPlan`: the largest token count (`rows`), whether any rank has prefill, whether any rank
still has work (the loop's exit), and whether any rank was asked to abort. A rank with no
tokens runs an idle forward of `rows` (the collectives only) instead of stalling the others.

It runs on the CPU (gloo) control group, so the decision never waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm_stats import CommStats


@dataclass(frozen=True)
class StepDemand:
    """What one rank scheduled: `num_tokens` rows, with a prefill chunk (`prefill`) or decode
    rows only; `unfinished`: it still has requests queued, running or in flight; `abort`: its
    driver asked to stop the run."""

    num_tokens: int
    prefill: bool
    unfinished: bool
    abort: bool = False


@dataclass(frozen=True)
class StepPlan:
    """What every rank runs this step: forwards over `rows` token rows (0: no rank has work for
    the device), of prefill kind if `prefill`; `busy`: some rank still has work after this
    step (keep stepping); `abort`: stop the run on every rank."""

    rows: int
    prefill: bool
    busy: bool
    abort: bool

    @classmethod
    def alone(cls, demand: StepDemand) -> StepPlan:
        """The plan of a rank without peers."""
        return cls(demand.num_tokens, demand.prefill, demand.unfinished, demand.abort)


@dataclass
class StepSync:
    """The agreement over `group` (every rank of the engine; a CPU/gloo group)."""

    group: dist.ProcessGroup
    stats: CommStats = field(default_factory=CommStats)

    def agree(self, demand: StepDemand) -> StepPlan:
        v = torch.tensor(
            [demand.num_tokens, demand.prefill, demand.unfinished, demand.abort],
            dtype=torch.int64,
        )
        with self.stats.timed():
            dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.group)
        rows, prefill, busy, abort = v.tolist()
        return StepPlan(int(rows), bool(prefill), bool(busy), bool(abort))
