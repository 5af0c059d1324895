"""What one rank's engine shares with the other ranks each step (`StepPeers`).

An `Engine` built with peers (one rank of a multi-rank engine) does three things per step that
a lone engine does not:
* after scheduling it states what it scheduled and gets the step's `StepPlan` (`agree`): the
  padded row count every rank's collectives use, and whether any rank still has work; a rank
  that scheduled nothing runs an idle forward of that many rows;
* if it is a follower of a DP rank replicated over several processes (D < world size), it
  takes the DP leader's sampled tokens (`share_samples`), so the replicas can never drift
  apart on a device whose kernels are not bitwise repeatable;
* the driver may ask it to stop (`request_abort`): the next agreement carries the request to
  every rank, and all of them abort in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepinfer_parallel.comm_stats import CommStats
from deepinfer_parallel.process_groups import RankGroups
from deepinfer_parallel.step_sync import StepDemand, StepPlan, StepSync


@dataclass
class StepPeers:
    """One rank's link to the others (see the module docstring); `last_plan` is the plan of the
    most recent step."""

    groups: RankGroups
    sync: StepSync = field(init=False)
    last_plan: StepPlan | None = None
    replica_stats: CommStats = field(default_factory=CommStats)
    _abort: bool = False

    def __post_init__(self) -> None:
        self.sync = StepSync(self.groups.control)

    def request_abort(self) -> None:
        self._abort = True

    def agree(self, num_tokens: int, prefill: bool, unfinished: bool) -> StepPlan:
        plan = self.sync.agree(StepDemand(num_tokens, prefill, unfinished, self._abort))
        if plan.abort:
            self._abort = False
        self.last_plan = plan
        return plan

    def share_samples(self, host: dict[str, torch.Tensor]) -> None:
        """Overwrite a follower's sampled tensors (token ids, health flags, logprobs) with its
        DP leader's, in place; a DP leader sends its own."""
        group = self.groups.replicas
        if group is None:
            return
        leader = self.groups.layout.dp_replica_groups()[self.groups.coords.dp_rank][0]
        with self.replica_stats.timed():
            for name in sorted(host):
                dist.broadcast(host[name], src=leader, group=group)
