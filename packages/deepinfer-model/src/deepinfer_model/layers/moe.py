"""Mixture of experts: sqrt-softplus router with bias, FP4 routed experts, FP8 shared expert.

Router (`gate`): ``s = sqrt(softplus(x Wg^T / gate_temp))`` fp32; ids = top-k of ``s + bias``;
weights = ``s[ids] / (sum + 1e-20) * routed_scaling_factor`` (`ops.moe_gate`); the
normalisation is skipped when `norm_topk_prob` is false or top-k is 1, as in the reference.
Expert: ``W2(w * silu(min(W1 x, L)) * clamp(W3 x, -L, L))`` (weight before W2; `ops.moe_experts`).
Shared expert: the same SwiGLU with FP8 weights, unweighted, added.

Parameters (HF names): `gate.weight [E, D]`, `gate.bias [E]` fp32, `gate.bias_vl [E]` fp32 (the
image-token bias; loaded, unused for text), `experts.E.{w1,w3}.{weight [I, D/2] int8, scale
[I, D/32] e8m0}`, `experts.E.w2.{weight [D, I/2], scale [D, I/32]}`,
`shared_experts.{w1,w2,w3}` (FP8 + scale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from deepinfer_kernels import REGISTRY, ops
from torch import nn

from ..config import ModelConfig
from . import rounding
from .linear import FP4Weight, FP8Linear, dense

if TYPE_CHECKING:
    from ..rank_shard import RankShard


class Gate(nn.Module):
    def __init__(
        self, config: ModelConfig, n_experts: int, topk: int, dtype: torch.dtype, device=None
    ) -> None:
        super().__init__()
        self.topk, self.route_scale, self.gate_temp = (
            topk,
            config.routed_scaling_factor,
            config.gate_temp,
        )
        # the reference normalises the chosen scores only `if norm_topk_prob and topk > 1`
        self.normalize = config.norm_topk_prob and topk > 1
        self.weight = nn.Parameter(
            torch.zeros(n_experts, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.bias = nn.Parameter(
            torch.zeros(n_experts, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias_vl = nn.Parameter(
            torch.zeros(n_experts, dtype=torch.float32, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] fp32, ids [T, k] int64).

        Without normalisation (`norm_topk_prob` false, or top-1 as in the reference) the weights
        are the raw chosen scores times `routed_scaling_factor`; `ops.moe_gate` always
        normalises, so that rare path recomputes the scores here.
        """
        w, ids = ops.moe_gate(
            x.float(), self.weight.float(), self.bias, self.topk, self.route_scale, self.gate_temp
        )
        if self.normalize:
            return w, ids
        s = torch.sqrt(F.softplus(dense(x.float(), self.weight.float()) / self.gate_temp))
        return s.gather(-1, ids) * self.route_scale, ids


class Expert(nn.Module):
    """One routed expert's FP4 matrices (computed in stacks by `MoE`)."""

    def __init__(self, dim: int, inter: int, device=None) -> None:
        super().__init__()
        self.w1 = FP4Weight(dim, inter, device)
        self.w2 = FP4Weight(inter, dim, device)
        self.w3 = FP4Weight(dim, inter, device)


class SharedExpert(nn.Module):
    """Dense SwiGLU with FP8 weights: x [T, D] -> [T, D]."""

    def __init__(self, dim: int, inter: int, limit: float, block: int, device=None) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = FP8Linear(dim, inter, block, device)
        self.w2 = FP8Linear(inter, dim, block, device)
        self.w3 = FP8Linear(dim, inter, block, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        return self.w2((F.silu(gate) * up).to(x.dtype))


class MoE(nn.Module):
    """x [T, D] -> [T, D]. `n_experts`/`topk` differ for the DSpark stages.

    fragment_order: None keeps the expert bytes in whichever order `ops.moe_experts` runs
    faster on for each call's device and kernel mode (`ops.moe_fragment_order_pays`; switching
    reorders them in place, expert by expert); True / False fixes the order.

    shard: under expert parallelism (`shard.experts`), MoE layer `layer` holds only this rank's
    physical slots (`experts[i]` is local slot i, holding logical expert
    `shard.experts.local_logical(layer)[i]`) and runs its routed experts over the EP group."""

    def __init__(
        self,
        config: ModelConfig,
        n_experts: int,
        topk: int,
        dtype: torch.dtype,
        device=None,
        fragment_order: bool | None = None,
        shard: RankShard | None = None,
        layer: int = 0,
    ) -> None:
        super().__init__()
        d, inter = config.hidden_size, config.moe_intermediate_size
        self.shard = shard if shard is not None and shard.experts is not None else None
        self.layer = layer
        self.limit = config.swiglu_limit
        if fragment_order and (d % 128 or inter % 128):
            raise ValueError(
                f"MoE: fragment-order expert weights need hidden and intermediate sizes that are "
                f"multiples of 128, got {d} and {inter}"
            )
        self.fragment_order = fragment_order
        self.gate = Gate(config, n_experts, topk, dtype, device)
        n_local = self.shard.experts.slots_per_rank if self.shard is not None else n_experts
        self.experts = nn.ModuleList(Expert(d, inter, device) for _ in range(n_local))
        self.shared_experts = SharedExpert(
            d, inter, config.swiglu_limit, config.fp8_block_size, device
        )
        self._stacks: dict[str, torch.Tensor] = {}
        self.register_load_state_dict_post_hook(lambda module, keys: module._stacks.clear())

    def _apply(self, fn, recurse: bool = True):
        # .to()/.cuda() move each expert parameter on its own: rebuild the stacks afterwards
        self._stacks = {}
        return super()._apply(fn, recurse)

    def stacked(self) -> dict[str, torch.Tensor]:
        """The expert weights as [E, ...] stacks (`w1.weight`, `w1.scale`, ...).

        Built on first use; afterwards every expert parameter is a view into its stack, so no
        weight is held twice and in-place loads (`param.copy_`) update the stack (write
        checkpoint-order bytes only after `use_checkpoint_order_`, see `FP4Weight`). Moving the
        module or `load_state_dict` (also with `assign=True`) rebuilds the stacks.
        """
        if not self._stacks:
            for name in ("w1", "w2", "w3"):
                for part in ("weight", "scale"):
                    params = [getattr(getattr(e, name), part) for e in self.experts]
                    st = torch.stack([p.data for p in params])
                    for i, p in enumerate(params):
                        p.data = st[i]
                    self._stacks[f"{name}.{part}"] = st
        return self._stacks

    def _use_order(self, device: torch.device) -> bool:
        """The byte order this call's experts get, reordering them in place when it changed (all
        matrices of the layer are in one order, so the first one tells)."""
        first = self.experts[0].w1
        want = self.fragment_order
        if want is None:
            want = ops.moe_fragment_order_pays(first.in_features, first.out_features, device)
        if want != first.fragment_order:
            for e in self.experts:
                for m in (e.w1, e.w2, e.w3):
                    m.set_fragment_order_(want)
        return want

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.experts[0].w1.master is not None:  # training mode (deepinfer_model.training)
            if self.shard is not None:
                raise NotImplementedError(
                    "training mode under expert parallelism: routed_experts needs every expert"
                )
            routed = rounding.routed_experts(x, weights, ids, self.experts, self.limit)
            return (routed.float() + self.shared_experts(x).float()).to(x.dtype)
        routed = (
            self._routed(x, weights, ids)
            if self.shard is None
            else self._routed_ep(x, weights, ids)
        )
        return (routed.float() + self.shared_experts(x).float()).to(x.dtype)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The local experts on x [M, D] with weights, ids [M, k] (local slot ids, -1 skips)."""
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        fragment_order = self._use_order(x.device)
        st = self.stacked()
        return ops.moe_experts(
            x,
            weights.contiguous(),
            ids.contiguous(),
            st["w1.weight"],
            st["w1.scale"],
            st["w3.weight"],
            st["w3.scale"],
            st["w2.weight"],
            st["w2.scale"],
            self.limit,
            fragment_order=fragment_order,
        )

    def _routed_ep(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts over the EP group: ids [T, k] logical -> physical slots -> the
        dispatch backend, padded to the forward scope's rows (exact order when batch-invariant)."""
        ep, scope = self.shard.experts, self.shard.scope
        ep.record(self.layer, ids, scope.valid)
        slots = ep.route(self.layer, ids, scope.keys)
        return ep.dispatch.routed(
            x, weights, slots, ids, self._routed, scope.rows, exact=REGISTRY.batch_invariant
        )

    def idle(self) -> None:
        """This layer's collectives with no tokens (a rank with nothing of its own to run)."""
        if self.shard is None:
            return
        d, k = self.gate.weight.shape[1], self.gate.topk
        dev = self.gate.weight.device
        x = torch.zeros(0, d, dtype=self.gate.weight.dtype, device=dev)
        empty = torch.zeros(0, k, dtype=torch.int64, device=dev)
        self._routed_ep(x, empty.float(), empty)

    @torch.inference_mode()  # the stacks are inference tensors when a forward built them
    def replace_experts_(self, stacks: dict[str, torch.Tensor]) -> None:
        """Overwrite the local expert stacks (same names and shapes as `stacked()`) in place,
        e.g. with the slots an EPLB rebalance moved here."""
        st = self.stacked()
        for name, new in stacks.items():
            st[name].copy_(new)
