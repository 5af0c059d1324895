"""One rank of a multi-rank engine (`RankEngine`): its groups, its model shard, its `Engine`,
and the step loop all ranks run together.

Built after the rank joined the default process group (a `LocalRanks` process of a single-node
`LLM`, or a torchrun process). `run(requests)` adds this DP rank's requests and steps until no
rank has work left: every rank calls `Engine.step()` the same number of times (the engine's
step agreement tells all of them when the last rank is done), then closes each step for online
EPLB (`end_step`: all ranks move expert weights after the same step). A rank with no requests
still runs every step (idle forwards). Only DP leaders report outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch
from deepinfer_model.loader import checkpoint_config, load_model
from deepinfer_model.rank_shard import RankShard
from deepinfer_model.runtime import ModelRuntime
from deepinfer_parallel.comm_stats import CommStats
from deepinfer_parallel.deep_ep_dispatch import deep_ep_reason
from deepinfer_parallel.dp_balance import RankLoad
from deepinfer_parallel.process_groups import RankGroups

from deepinfer_engine.config import EngineConfig, resolve_device
from deepinfer_engine.engine import Engine, Request
from deepinfer_engine.outputs import RequestOutput
from deepinfer_engine.step_messages import RankReady, RankRequest, RankTimes
from deepinfer_engine.step_peers import StepPeers
from deepinfer_engine.validation import ValidatedRequest

logger = logging.getLogger("deepinfer.engine")


def resolve_dispatch(name: str | None, device: str) -> str:
    """The MoE dispatch backend: `name`, or DeepEP when it imports on CUDA, else all-gather."""
    if name is not None:
        return name
    return "deep_ep" if device == "cuda" and deep_ep_reason() is None else "allgather"


def check_rank_features(config: EngineConfig, device: str) -> None:
    """Refuse, before anything starts or loads, what ranks cannot do here."""
    if config.expert_dispatch == "deep_ep":
        why = deep_ep_reason()
        if why is not None:
            raise ValueError(f"expert_dispatch='deep_ep': {why}; use 'allgather' or 'alltoall'")


class RankEngine:
    """See the module docstring. `device_index`: this rank's accelerator on its node."""

    def __init__(self, config: EngineConfig, device_index: int) -> None:
        layout = config.layout
        self.groups = RankGroups.create(layout)
        device = resolve_device(config.accelerator)
        if device == "cuda":
            torch.cuda.set_device(device_index)
        path, model_config = checkpoint_config(config.model)
        self.shard = RankShard.build(
            self.groups,
            model_config,
            device=device,
            extra_experts=config.num_extra_experts,
            dispatch=resolve_dispatch(config.expert_dispatch, device),
            eplb_window=config.expert_count_window_size,
            eplb_interval=config.expert_rearrangement_step_interval,
        )
        loaded = load_model(
            str(path), device, config.torch_dtype(device), progress=False, shard=self.shard
        )
        self.report = loaded.report
        self.runtime = ModelRuntime.from_loaded(loaded)
        self.peers = StepPeers(self.groups)
        self.engine = Engine(config, self.runtime, peers=self.peers)
        self._times = RankTimes()

    @property
    def is_dp_leader(self) -> bool:
        return self.groups.coords.is_dp_leader

    def ready(self) -> RankReady:
        return RankReady(
            rank=self.groups.rank,
            max_model_len=self.engine.max_model_len,
            loaded_bytes=self.report.num_bytes if self.report is not None else 0,
            peak_rss_bytes=self.report.peak_rss_bytes if self.report is not None else 0,
        )

    def run(
        self, requests: list[RankRequest], should_abort: Callable[[], bool] = lambda: False
    ) -> Iterator[list[RequestOutput]]:
        """Run `requests` (this DP rank's) with the other ranks until none has work; yields the
        outputs of the requests that finished in each step. `should_abort` is asked before every
        step; when it (on any rank) says so, every rank aborts its requests in the same step
        (they finish with finish_reason "error")."""
        eng = self.engine
        driver_id: dict[str, str] = {}
        pending: dict[str, Request] = {}
        for r in requests:
            req = eng.add_request(ValidatedRequest(r.prompt, r.prompt_token_ids, r.params))
            driver_id[req.request_id] = r.request_id
            pending[req.request_id] = req
        for stats in self._comm_stats():
            stats.reset()
        self.peers.sync.stats.reset()
        steps0 = time.perf_counter()
        steps = 0
        asked = False
        while True:
            if not asked and should_abort():
                asked = True
                self.peers.request_abort()
            eng.step()
            steps += 1
            plan = self.peers.last_plan
            if plan.abort:
                eng.abort_all("generate was interrupted on another rank or by the driver")
            if self.runtime.end_step():
                logger.info("EPLB: experts rearranged after step %d", eng.stats.steps)
            done = [rid for rid, req in pending.items() if req.finished]
            if done:
                outputs = []
                for rid in done:
                    out = pending.pop(rid).to_output()
                    out.request_id = driver_id[rid]
                    outputs.append(out)
                yield outputs
            if not plan.busy:
                break
        self._record_times(steps, time.perf_counter() - steps0)

    def _comm_stats(self) -> list[CommStats]:
        """The timers of this rank's data collectives: MoE dispatch, Engram lookups, replica
        sample broadcasts."""
        out = [self.peers.replica_stats]
        if self.shard.experts is not None:
            out.append(self.shard.experts.dispatch.stats)
        out += [rows.stats for rows in self.shard.engram or []]
        return out

    def _record_times(self, steps: int, seconds: float) -> None:
        ep = self.shard.experts
        eplb = ep.eplb if ep is not None else None
        self._times = RankTimes(
            steps=steps,
            steps_s=seconds,
            sync_s=self.peers.sync.stats.seconds,
            comm_s=sum(s.seconds for s in self._comm_stats()),
            rebalances=eplb.rebalances if eplb is not None else 0,
        )

    def times(self) -> RankTimes:
        """Timings of the last `run`."""
        return self._times

    def load(self) -> RankLoad:
        """Tokens this DP rank still has to prefill, and tokens its KV cache holds."""
        sch = self.engine.scheduler
        waiting = sum(s.num_tokens - s.num_computed_tokens for s in [*sch.waiting, *sch.running])
        kv = self.engine.kv
        return RankLoad(waiting, (kv.num_blocks - kv.num_free_blocks) * kv.block_size)
