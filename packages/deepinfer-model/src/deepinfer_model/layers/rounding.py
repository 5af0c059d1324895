"""The checkpoint's rounding computed from fp32 master weights, with straight-through gradients:
what the weight containers (`linear.FP8Linear`, `linear.FP4Weight` in `moe.MoE`,
`engram.EngramTable`) compute from while training mode (`deepinfer_model.training`) gives them
a `master`, and the KV fake-quantisation's gradient path (`straight_through`). Each rounding
is the one the checkpoint or `ops` applies; the gradient passes it unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from deepinfer_kernels import quant
from deepinfer_kernels.ref.moe import swiglu
from torch import nn

_SIMULATE: ContextVar[bool] = ContextVar("simulate_checkpoint_rounding", default=True)


@contextlib.contextmanager
def unquantized() -> Iterator[None]:
    """Inside the block, masters are used as they are: no weight or activation rounding (the
    model's KV fake-quantisation, a model setting, is unchanged)."""
    token = _SIMULATE.set(False)
    try:
        yield
    finally:
        _SIMULATE.reset(token)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, args):
        return fn(x, *args)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def straight_through(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
    """``fn(x, *args)`` (a rounding of x: same shape and dtype); where autograd records it, the
    gradient reaches x unchanged. Without autograd this is the plain call."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x, fn, args)
    return fn(x, *args)


def _fp8_blocks(w: torch.Tensor) -> torch.Tensor:
    q, s = quant.quantize_fp8_blocks(w)
    return quant.dequantize_fp8_blocks(q, s, w.dtype)


def _fp4_experts(w: torch.Tensor) -> torch.Tensor:
    q, s = quant.quantize_fp4_experts(w)
    return quant.dequantize_fp4(q, s, w.dtype)


def _rounded_linear(
    x: torch.Tensor, master: torch.Tensor, weight_rounding: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    if _SIMULATE.get():
        x = straight_through(quant.fake_quant_fp8_ue8m0, x, quant.FP8_BLOCK)
        master = straight_through(weight_rounding, master)
    return F.linear(x, master.to(x.dtype))


def fp8_linear(x: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> [..., out] x.dtype from an fp32 master [out, in] (FP8 rounding, STE)."""
    return _rounded_linear(x, master, _fp8_blocks)


def fp8_weight(master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The master [out, in] rounded to FP8 32x32 blocks (STE), as `dtype`."""
    return (straight_through(_fp8_blocks, master) if _SIMULATE.get() else master).to(dtype)


def engram_rows(master: torch.Tensor, ids: torch.Tensor, block: int) -> torch.Tensor:
    """Rows `ids` [...] of an fp32 table master [rows, hd] -> [..., hd], each rounded to FP8
    per `block` with power-of-two scales as the checkpoint stores the table (STE)."""
    rows = master[ids]
    if _SIMULATE.get():
        rows = straight_through(quant.fake_quant_fp8_ue8m0, rows, block)
    return rows


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: nn.ModuleList,
    swiglu_limit: float,
) -> torch.Tensor:
    """`ops.moe_experts` from the experts' fp32 masters: x [T, D], weights [T, k] fp32, ids
    [T, k] -> [T, D] x.dtype (FP4 weight and FP8 activation rounding, STE)."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        ex = experts[e]
        xe = x[rows]
        gate = _rounded_linear(xe, ex.w1.master, _fp4_experts)
        up = _rounded_linear(xe, ex.w3.master, _fp4_experts)
        h = swiglu(gate, up, weights[rows, slots, None], swiglu_limit)
        y = y.index_add(0, rows, _rounded_linear(h, ex.w2.master, _fp4_experts).float())
    return y.to(x.dtype)
