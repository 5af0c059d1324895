"""The engine of a multi-rank `LLM` launched by torchrun (`TorchrunExecutor`): this process is
one rank, and every rank runs the same script (SPMD).

Every rank calls `LLM(...)` with the same arguments (the launcher's RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT say where it is: the rendezvous uses only that address)
and `generate` with the same prompts; each DP rank runs the requests the load balancer gives it
(every rank computes the same assignment from the same loads), and the finished outputs are
gathered over the control group, so every rank returns all of them. The ranks check that they
were given the same requests (a hash of them) and raise if not.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib

import torch
import torch.distributed as dist
from deepinfer_parallel.dp_balance import RankLoad
from deepinfer_parallel.rendezvous import init_rank_from_launcher

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.rank_engine import RankEngine
from deepinfer_engine.request_front import RemoteRequest, RequestFront
from deepinfer_engine.step_messages import Generate, RankOutputs, decode, encode


def _all_gather_bytes(data: bytes, group: dist.ProcessGroup) -> list[bytes]:
    """Every rank's `data` over a CPU group (lengths first, then the padded bytes)."""
    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [bytes(b[: int(s)].tolist()) for b, s in zip(bufs, sizes, strict=True)]


class TorchrunExecutor(RequestFront):
    """See the module docstring. `config.launched` is set."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        launched = config.launched
        init_rank_from_launcher(
            launched.rank,
            launched.world_size,
            "nccl" if self.device == "cuda" else "gloo",
            config.collective_timeout_s,
        )
        resolved = dataclasses.replace(config, model=str(self.path))
        self.rank = RankEngine(resolved, launched.local_rank)
        control = self.rank.groups.control
        mml = torch.tensor([self.rank.engine.max_model_len])
        dist.all_reduce(mml, op=dist.ReduceOp.MIN, group=control)
        self.max_model_len = int(mml)

    def has_unfinished(self) -> bool:
        return bool(self._queued)

    def step(self) -> list[RemoteRequest]:
        """Run every queued request to the end on all ranks; return them all, finished."""
        if self.rank is None:
            raise RuntimeError("this LLM was shut down")
        layout, coords = self.config.layout, self.rank.groups.coords
        control = self.rank.groups.control
        queued, wire, dp_of = self.take_queued()
        digest = hashlib.sha256(encode(Generate(wire))).digest()
        digests = _all_gather_bytes(digest, control)
        if any(d != digests[0] for d in digests):
            raise ValueError(
                "the torchrun ranks were given different requests: every rank must call "
                "generate with the same prompts and sampling parameters"
            )
        mine = [w for w, d in zip(wire, dp_of, strict=True) if d == coords.dp_rank]
        outputs = [out for step in self.rank.run(mine) for out in step]
        # the loads the next assignment starts from: every DP leader's, on every rank
        loads = torch.zeros(layout.data_parallel_size, 2, dtype=torch.int64)
        if coords.is_dp_leader:
            load = self.rank.load()
            loads[coords.dp_rank] = torch.tensor([load.waiting_tokens, load.kv_tokens])
        dist.all_reduce(loads, group=control)
        self.loads = [RankLoad(int(w), int(kv)) for w, kv in loads.tolist()]
        by_id = {r.request_id: r for r in queued}
        mine_out = encode(RankOutputs(outputs if coords.is_dp_leader else []))
        for data in _all_gather_bytes(mine_out, control):
            msg = decode(data)
            for out in msg.outputs:
                by_id[out.request_id].output = out
                self.stats.tokens_generated += sum(len(c.token_ids) for c in out.outputs)
        self.stats.steps += 1
        return queued

    def abort_all(self, reason: str) -> None:
        self.fail_queued(reason)

    def shutdown(self) -> None:
        """Release this rank's model and process groups (idempotent). The groups' last
        references go first, so that their threads are joined now rather than while the
        interpreter tears down."""
        self.rank = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
