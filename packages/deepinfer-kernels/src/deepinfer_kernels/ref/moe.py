"""Reference MoE: the router gate and the routed FP4 experts, written as the reference model does.

Gate: ``s = sqrt(softplus(x W^T / gate_temp))`` in fp32; experts chosen by ``topk(s + bias)``; the
weights are ``s[ids] / (sum s[ids] + 1e-20) * route_scale``.

Experts (per expert e, over the tokens routed to it): ``h = swiglu(W1 x, W3 x) * weight`` rounded
to x.dtype, then ``W2 h``, each linear quantising its input per 32 to FP8 (UE8M0) and expanding the
FP4 weights exactly; W1/W3/W2 outputs rounded to x.dtype as the reference's linears return. The
expert outputs are summed into fp32 in ascending expert order and returned as x.dtype. Entries of
`topk_ids` that are negative (experts held by another rank) contribute nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import quant
from .linear import matmul_rows


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    route_weight: torch.Tensor | None,
    swiglu_limit: float,
) -> torch.Tensor:
    """V4.1's clamped SwiGLU times the routing weight, in fp32, rounded to gate.dtype.

    ``silu(min(gate, limit)) * clamp(up, -limit, limit) * route_weight`` (no clamp when limit <= 0).
    gate, up: [..., I]; route_weight: [..., 1] fp32 or None.
    """
    g, u = gate.float(), up.float()
    if swiglu_limit > 0:
        u = u.clamp(-swiglu_limit, swiglu_limit)
        g = g.clamp(max=swiglu_limit)
    h = F.silu(g) * u
    if route_weight is not None:
        h = route_weight.float() * h
    return h.to(gate.dtype)


def gate_scores(x: torch.Tensor, weight: torch.Tensor, gate_temp: float, batch_invariant: bool):
    """[T, D], [E, D] -> sqrt(softplus(x W^T / gate_temp)) [T, E] fp32."""
    logits = matmul_rows(x.float(), weight.float().t(), batch_invariant)
    return torch.sqrt(F.softplus(logits / gate_temp))


def moe_gate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    route_scale: float,
    gate_temp: float = 1.0,
    *,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], weight [E, D], bias [E] or [T, E] fp32 (only for choosing) ->
    (topk_weights [T, topk] fp32, topk_ids [T, topk] int64)."""
    s = gate_scores(x, weight, gate_temp, batch_invariant)
    choose = s if bias is None else s + bias.float()
    ids = choose.topk(topk, dim=-1).indices
    w = s.gather(-1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * route_scale
    return w, ids


def fp4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, batch_invariant: bool
) -> torch.Tensor:
    """x [M, K] -> [M, N] x.dtype with FP4 weights packed [N, K/2], scale [N, K/32]."""
    xq, xs = quant.act_quant_fp8(x)
    xd = quant.act_dequant_fp8(xq, xs, torch.float32)
    wd = quant.dequantize_fp4(packed, scale, torch.float32)
    return matmul_rows(xd, wd.t(), batch_invariant).to(x.dtype)


def moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor,
    w3: torch.Tensor,
    s3: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    swiglu_limit: float,
    *,
    batch_invariant: bool = False,
    fragment_order: bool = False,
) -> torch.Tensor:
    """x [T, D]; topk_weights [T, k] fp32; topk_ids [T, k] int64 (< 0: skip);
    w1/w3 [E, I, D/2] int8 with s1/s3 [E, I, D/32] e8m0; w2 [E, D, I/2] with s2 [E, D, I/32]
    -> [T, D] x.dtype. fragment_order: w1, w3, w2 are in `quant.fp4_fragment_order`."""
    if fragment_order:
        w1, w3, w2 = (quant.fp4_checkpoint_order(w) for w in (w1, w3, w2))
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        xe = x[rows]
        gate = fp4_linear(xe, w1[e], s1[e], batch_invariant)
        up = fp4_linear(xe, w3[e], s3[e], batch_invariant)
        h = swiglu(gate, up, topk_weights[rows, slots, None], swiglu_limit)
        y.index_add_(0, rows, fp4_linear(h, w2[e], s2[e], batch_invariant).float())
    return y.to(x.dtype)
