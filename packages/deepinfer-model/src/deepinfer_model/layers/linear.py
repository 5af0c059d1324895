"""Weight containers in the checkpoint formats, and the linears computed from them.

- `FP8Linear`: ``weight [out, in] float8_e4m3fn`` + ``scale [ceil(out/32), ceil(in/32)]
  float8_e8m0fnu`` (32x32 blocks), computed by `ops.fp8_linear` (activations quantised per 32).
- `Linear`: a plain weight in the model dtype (or fp32 where the reference computes in fp32).
- `FP4Weight`: an expert matrix, ``weight [out, in/2] int8`` (two e2m1 per byte, low nibble
  first) + ``scale [out, in/32] float8_e8m0fnu``; computed by `ops.moe_experts` from stacks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer_kernels import REGISTRY, ops, quant
from torch import nn

from . import rounding

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float8_e8m0fnu


def dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T in the common dtype of x and w -> [..., N].

    With DEEPINFER_BATCH_INVARIANT=1 each row is its own product, so a row's result does not
    depend on how many rows share the call (prefill == decode bitwise, even through the
    quantisers downstream).
    """
    x2 = x.reshape(-1, x.shape[-1])
    if REGISTRY.batch_invariant and x2.shape[0] > 1:
        y = torch.cat([F.linear(x2[i : i + 1], w) for i in range(x2.shape[0])])
    else:
        y = F.linear(x2, w)
    return y.view(*x.shape[:-1], w.shape[0])


def _frozen(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None
) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class FP8Linear(nn.Module):
    """y = x W^T with W stored FP8 e4m3 in 32x32 blocks with UE8M0 scales.

    x: [..., in] (model dtype) -> [..., out] x.dtype, through `ops.fp8_linear`.
    """

    def __init__(self, in_features: int, out_features: int, block: int = 32, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = _frozen((out_features, in_features), FP8_DTYPE, device)
        self.scale = _frozen(
            (-(-out_features // block), -(-in_features // block)), SCALE_DTYPE, device
        )
        # training mode only (`deepinfer_model.training`): an fp32 [out, in] master weight
        self.register_parameter("master", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.master is not None:
            return rounding.fp8_linear(x, self.master)
        y = ops.fp8_linear(x.reshape(-1, self.in_features), self.weight, self.scale)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as [out, in] `dtype` (exact)."""
        if self.master is not None:
            return rounding.fp8_weight(self.master, dtype)
        return quant.dequantize_fp8_blocks(self.weight, self.scale, dtype)


class Linear(nn.Module):
    """y = x W^T with a plain weight [out, in]; computed in the weight's dtype, returned in
    `out_dtype` (default: x.dtype)."""

    def __init__(
        self, in_features: int, out_features: int, dtype: torch.dtype, device=None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _frozen((out_features, in_features), dtype, device)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = dense(x.to(self.weight.dtype), self.weight)
        return y.to(out_dtype or x.dtype)


class FP4Weight(nn.Module):
    """One FP4 e2m1 expert matrix: weight [out, in/2] int8, scale [out, in/32] e8m0.

    `fragment_order`: whether `weight` holds its bytes in `quant.fp4_fragment_order` (the MoE
    layer switches it with `set_fragment_order_` where the kernels run faster so). The state
    dict stays in the checkpoint's order either way: `state_dict()` returns checkpoint-order
    copies and `load_state_dict` takes checkpoint order, but `state_dict(keep_vars=True)` gives
    the live parameter, so an in-place writer of checkpoint bytes calls
    `use_checkpoint_order_` on the model first (as the loader does).
    """

    def __init__(self, in_features: int, out_features: int, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _frozen((out_features, in_features // 2), torch.int8, device)
        self.scale = _frozen((out_features, in_features // 32), SCALE_DTYPE, device)
        self.fragment_order = False
        # training mode only (`deepinfer_model.training`): an fp32 [out, in] master weight
        self.register_parameter("master", None)

    @torch.no_grad()
    def set_fragment_order_(self, fragment_order: bool) -> None:
        """Reorder `weight`'s bytes in place (through one temporary of its size)."""
        if fragment_order != self.fragment_order:
            order = quant.fp4_fragment_order if fragment_order else quant.fp4_checkpoint_order
            self.weight.copy_(order(self.weight))
            self.fragment_order = fragment_order

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.fragment_order and not keep_vars:
            key = prefix + "weight"
            destination[key] = quant.fp4_checkpoint_order(destination[key])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "weight"
        if self.fragment_order and getattr(state_dict.get(key), "shape", None) == self.weight.shape:
            state_dict[key] = quant.fp4_fragment_order(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def use_checkpoint_order_(model: nn.Module) -> None:
    """Put every FP4 expert matrix of `model` back in the checkpoint's byte order: call before
    writing checkpoint bytes into the parameters in place."""
    for module in model.modules():
        if isinstance(module, FP4Weight):
            module.set_fragment_order_(False)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: x [..., d] -> [..., d] x.dtype (fp32 statistics)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Embedding(nn.Module):
    """`weight [vocab, D]`: ids [...] -> [..., D]."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.zeros(vocab, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
