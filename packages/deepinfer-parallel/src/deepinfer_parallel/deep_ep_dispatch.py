"""The DeepEP backend of `expert_dispatch` (DeepSeek's `deep_ep`, used when it is importable).

Two DeepEP buffers over the EP group, as DeepEP recommends:
* normal mode (prefill-sized steps): `get_dispatch_layout` + `dispatch` send each token once to
  each rank holding one of its experts, with its top-k slots mapped to that rank's local experts
  (-1 elsewhere) and its weights; the local kernel sums those experts; `combine` adds the
  per-rank partial sums back at the token's rank;
* low-latency mode (decode-sized steps, rows <= `max_decode_tokens`): `low_latency_dispatch`
  lays the tokens out per local expert (``[local experts, max_tokens * ranks, D]``, the first
  `recv_count[e]` rows valid); the local kernel runs them with weight 1 and
  `low_latency_combine` applies the routing weights while summing. The weight is then applied
  after W2 instead of before it, so results differ from the single-rank engine by rounding.
Batch-invariant engines (`exact=True`) need each token's expert outputs added in the fixed
reference order, which DeepEP's combine does not promise: those calls go through the
all-gather backend's exact path instead.

Needs CUDA, bf16 activations and a DeepEP build; nothing here runs on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm_stats import CommStats
from .expert_dispatch import AllGatherDispatch, ExpertCompute, ExpertShard

NORMAL_BUFFER_BYTES = 1 << 30
"""NVLink buffer of the normal-mode kernels (DeepEP's tests use 1 GiB for intranode runs)."""


def deep_ep_reason() -> str | None:
    """Why the DeepEP backend cannot run here, or None."""
    if not torch.cuda.is_available():
        return "DeepEP needs CUDA"
    try:
        import deep_ep  # noqa: F401
    except Exception as exc:  # any failure to import means "not here"
        return f"deep_ep does not import: {type(exc).__name__}: {exc}"
    return None


@dataclass
class DeepEPDispatch:
    """See the module docstring. `hidden_size`: the token width D; `max_decode_tokens`: rows
    per rank up to which a step uses the low-latency kernels (all ranks pass the same)."""

    group: dist.ProcessGroup
    shard: ExpertShard
    hidden_size: int
    max_decode_tokens: int = 256
    stats: CommStats = field(default_factory=CommStats)
    name: str = "deep_ep"

    def __post_init__(self) -> None:
        why = deep_ep_reason()
        if why is not None:
            raise RuntimeError(f"expert dispatch 'deep_ep': {why}; use 'allgather' or 'alltoall'")
        import deep_ep

        self._deep_ep = deep_ep
        self._normal = deep_ep.Buffer(self.group, num_nvl_bytes=NORMAL_BUFFER_BYTES)
        self._low_latency = None
        self._exact = AllGatherDispatch(self.group, self.shard, self.stats)

    def _ll_buffer(self):
        if self._low_latency is None:
            n = self.shard.num_physical
            size = self._deep_ep.Buffer.get_low_latency_rdma_size_hint(
                self.max_decode_tokens, self.hidden_size, self.shard.ep_size, n
            )
            self._low_latency = self._deep_ep.Buffer(
                self.group,
                num_rdma_bytes=size,
                low_latency_mode=True,
                num_qps_per_rank=max(1, self.shard.slots_per_rank),
            )
        return self._low_latency

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
        if exact:
            return self._exact.routed(x, weights, slots, logical, compute, rows, exact=True)
        slots = slots.to(torch.int64)
        weights = weights.float()
        if rows <= self.max_decode_tokens:
            return self._low_latency_routed(x, weights, slots, compute)
        buf = self._normal
        n = self.shard.num_physical
        with self.stats.timed():
            per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(slots, n)
            recv_x, recv_ids, recv_w, _, handle, _ = buf.dispatch(
                x,
                topk_idx=slots,
                topk_weights=weights,
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma_rank,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
            )
        y = compute(recv_x, recv_w, recv_ids)
        with self.stats.timed():
            out, _, _ = buf.combine(y, handle)
        return out

    def _low_latency_routed(self, x, weights, slots, compute) -> torch.Tensor:
        buf = self._ll_buffer()
        n, d = self.shard.num_physical, x.shape[1]
        with self.stats.timed():
            recv, counts, handle, _, _ = buf.low_latency_dispatch(
                x, slots, self.max_decode_tokens, n, use_fp8=False
            )
        experts, cap = recv.shape[0], recv.shape[1]
        row = torch.arange(cap, device=x.device)
        valid = row[None, :] < counts[:, None]  # [local experts, cap]
        local = torch.arange(experts, device=x.device)[:, None].expand(experts, cap)
        ids = local.masked_fill(~valid, -1).reshape(-1, 1)
        ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
        y = compute(recv.reshape(-1, d), ones, ids).view(experts, cap, d)
        with self.stats.timed():
            out, _, _ = buf.low_latency_combine(y, slots, weights, handle)
        return out
