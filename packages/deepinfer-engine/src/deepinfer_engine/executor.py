"""The engine of a multi-rank `LLM` on one node (`MultiprocExecutor`): one process per rank.

The `LLM` process is the driver: it holds the tokenizer and no weights, checks the layout
against the checkpoint and the machine before anything loads, starts the ranks
(`deepinfer_parallel.local_ranks.LocalRanks`: rendezvous and collectives on 127.0.0.1, a port
the OS picks), and then serves `LLM.generate` with the engine interface the LLM drives
(`add_request`, `step`, `has_unfinished`, `abort_all`, ...):

* the first `step()` of a run spreads the queued requests over the DP ranks by load
  (`dp_balance.assign_requests`: waiting tokens + KV use, from each rank's last `RankDone`) and
  sends every rank its `Generate` (DP replicas get the same requests; ranks with none still
  run every step);
* each later `step()` waits for the next `RankOutputs` (requests finished on a DP leader) and
  returns those requests; the run ends when every rank sent `RankDone`;
* a rank that dies or raises makes `step()` raise `RankFailure` naming it (every other rank is
  stopped first, so nothing is left behind); the executor is then closed for good;
* `abort_all` (generate interrupted, e.g. Ctrl-C) asks every rank to stop at its next step and
  waits for them, so the next `generate` starts clean.

`shutdown()` ends the ranks (also at interpreter exit and when the executor is collected).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import weakref

from deepinfer_parallel.local_ranks import LocalRanks, RankFailure

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.request_front import RemoteRequest, RequestFront
from deepinfer_engine.step_messages import (
    Abort,
    Generate,
    MessageError,
    RankDone,
    RankOutputs,
    RankReady,
    RankRequest,
    Shutdown,
    decode,
    encode,
)
from deepinfer_engine.validation import ValidatedRequest
from deepinfer_engine.worker import rank_main

logger = logging.getLogger("deepinfer.engine")

ABORT_WAIT_S = 120.0
"""How long an abort waits for the ranks to stop before they are killed."""


def _init_fields(config: EngineConfig) -> dict:
    """The config's constructor arguments (what a rank rebuilds it from; no environment)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def _rank_threads(world: int) -> int:
    """Intra-op threads per rank: the node's cores shared out (ranks also poll and copy)."""
    return max(1, (os.cpu_count() or 1) // world)


class MultiprocExecutor(RequestFront):
    """See the module docstring. `config.layout.world_size` > 1."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        layout = config.layout
        resolved = dataclasses.replace(config, model=str(self.path), launched=None)
        self._ranks = LocalRanks(
            rank_main,
            layout.world_size,
            backend="nccl" if self.device == "cuda" else "gloo",
            threads=_rank_threads(layout.world_size),
            timeout_s=config.collective_timeout_s,
            args=(json.dumps(_init_fields(resolved)),),
            preload=("deepinfer_engine.worker",),
        )
        self._finalizer = weakref.finalize(self, self._ranks.close)
        self._failure: RankFailure | None = None
        ready: dict[int, RankReady] = {}
        try:
            while len(ready) < layout.world_size:
                rank, payload = self._ranks.recv()
                msg = decode(payload)
                if not isinstance(msg, RankReady):
                    raise MessageError(f"rank {rank}: expected RankReady, got {msg}")
                ready[rank] = msg
        except BaseException:
            self._ranks.close()
            raise
        self.ready = [ready[r] for r in range(layout.world_size)]
        self.max_model_len = min(r.max_model_len for r in self.ready)
        self._running: dict[str, RemoteRequest] = {}
        self._done: set[int] = set()
        self._in_run = False
        self.last_run: list[RankDone] = []
        logger.info(
            "%d ranks ready (data=%d, expert=%d, engram=%d): max_model_len %d, loaded %s MiB, "
            "peak RSS %s MiB per rank",
            layout.world_size,
            layout.data_parallel_size,
            layout.expert_parallel_size,
            layout.engram_parallel_size,
            self.max_model_len,
            [r.loaded_bytes >> 20 for r in self.ready],
            [r.peak_rss_bytes >> 20 for r in self.ready],
        )

    # ---- the engine interface LLM drives -----------------------------------------------------
    def add_request(self, req: ValidatedRequest) -> RemoteRequest:
        self._check_alive()
        return super().add_request(req)

    def has_unfinished(self) -> bool:
        return bool(self._queued) or self._in_run

    def step(self) -> list[RemoteRequest]:
        """Start a run with the queued requests, or wait for the next finished ones."""
        self._check_alive()
        if not self._in_run:
            self._start_run()
            return []
        try:
            rank, payload = self._ranks.recv()
        except RankFailure as e:
            self._failure = e
            raise
        msg = decode(payload)
        self.stats.steps += 1
        if isinstance(msg, RankOutputs):
            finished = []
            for out in msg.outputs:
                req = self._running.pop(out.request_id)
                req.output = out
                self.stats.tokens_generated += sum(len(c.token_ids) for c in out.outputs)
                finished.append(req)
            return finished
        if isinstance(msg, RankDone):
            self._rank_done(msg)
            return []
        raise MessageError(f"rank {rank}: unexpected {type(msg).__name__} in a run")

    def abort_all(self, reason: str) -> None:
        """Stop the run in progress on every rank (their requests end with an error) and
        wait for it; requests not sent yet end with `reason`."""
        self.fail_queued(reason)
        if self._in_run and self._failure is None:
            try:
                self._ranks.send_all(encode(Abort(reason)))
                while self._in_run:
                    _, payload = self._ranks.recv(timeout_s=ABORT_WAIT_S)
                    msg = decode(payload)
                    if isinstance(msg, RankOutputs):
                        for out in msg.outputs:
                            self._running.pop(out.request_id).output = out
                    elif isinstance(msg, RankDone):
                        self._rank_done(msg)
            except (RankFailure, TimeoutError, OSError, MessageError) as e:
                logger.error("ranks did not stop cleanly (%s): shutting them down", e)
                self._failure = e if isinstance(e, RankFailure) else RankFailure(-1, str(e))
                self._ranks.close()
        for r in self._running.values():
            r.fail(reason)
        self._running = {}
        self._in_run = False

    def shutdown(self) -> None:
        """End the rank processes (idempotent)."""
        if not self._in_run and self._failure is None:
            try:
                self._ranks.send_all(encode(Shutdown()))
                self._ranks.join(timeout_s=10.0)
            except (RankFailure, OSError, RuntimeError):
                pass  # closing below stops whatever still runs
        self._ranks.close()
        self._finalizer.detach()

    @property
    def pids(self) -> list[int | None]:
        return self._ranks.pids

    # ---- internals ---------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(
                f"the engine's rank processes are gone (rank {self._failure.rank} failed: "
                f"{str(self._failure).splitlines()[0]}); create a new LLM"
            )

    def _start_run(self) -> None:
        layout = self.config.layout
        queued, wire, dp_of = self.take_queued()
        per_dp: list[list[RankRequest]] = [[] for _ in range(layout.data_parallel_size)]
        for r, w, d in zip(queued, wire, dp_of, strict=True):
            per_dp[d].append(w)
            self._running[r.request_id] = r
        self._done = set()
        self.last_run = []
        self._in_run = True
        try:
            for rank in range(layout.world_size):
                d = layout.coords(rank).dp_rank
                self._ranks.send(rank, encode(Generate(per_dp[d])))
        except RankFailure as e:
            self._failure = e
            raise

    def _rank_done(self, msg: RankDone) -> None:
        self._done.add(msg.rank)
        self.last_run.append(msg)
        coords = self.config.layout.coords(msg.rank)
        if coords.is_dp_leader:
            self.loads[coords.dp_rank] = msg.load
        if len(self._done) == self.config.layout.world_size:
            self._in_run = False
            self.last_run.sort(key=lambda m: m.rank)
