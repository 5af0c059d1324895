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
from typing import ClassVar

import torch

from .expert_dispatch import AllGatherDispatch, ExpertDispatch, RoutedCall

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
class DeepEPDispatch(ExpertDispatch):
    """See the module docstring. `hidden_size`: the token width D; `max_decode_tokens`: rows
    per rank up to which a step uses the low-latency kernels (all ranks pass the same)."""

    hidden_size: int = field(kw_only=True)
    max_decode_tokens: int = field(default=256, kw_only=True)
    name: ClassVar[str] = "deep_ep"

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

    def _routed(self, call: RoutedCall) -> torch.Tensor:
        if call.exact:
            return self._exact._routed(call)
        if call.rows <= self.max_decode_tokens:
            return self._low_latency_routed(call)
        buf = self._normal
        n = self.shard.num_physical
        with self.stats.timed():
            per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(call.slots, n)
            recv_x, recv_ids, recv_w, _, handle, _ = buf.dispatch(
                call.x,
                topk_idx=call.slots,
                topk_weights=call.weights,
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma_rank,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
            )
        y = call.compute(recv_x, recv_w, recv_ids)
        with self.stats.timed():
            out, _, _ = buf.combine(y, handle)
        return out

    def _low_latency_routed(self, call: RoutedCall) -> torch.Tensor:
        buf = self._ll_buffer()
        x = call.x
        n, d = self.shard.num_physical, x.shape[1]
        with self.stats.timed():
            recv, counts, handle, _, _ = buf.low_latency_dispatch(
                x, call.slots, self.max_decode_tokens, n, use_fp8=False
            )
        experts, cap = recv.shape[0], recv.shape[1]
        row = torch.arange(cap, device=x.device)
        valid = row[None, :] < counts[:, None]  # [local experts, cap]
        local = torch.arange(experts, device=x.device)[:, None].expand(experts, cap)
        ids = local.masked_fill(~valid, -1).reshape(-1, 1)
        ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
        y = call.compute(recv.reshape(-1, d), ones, ids).view(experts, cap, d)
        with self.stats.timed():
            out, _, _ = buf.low_latency_combine(y, call.slots, call.weights, handle)
        return out
