"""MoE ops: the router gate (sqrt-softplus + bias, top-k, normalised weights x route_scale) and the
routed FP4 experts (permute, W1/W3, clamped SwiGLU x routing weight, W2, weighted combine).

The shared expert is not here: it is a dense FP8 MLP the model computes with `ops.fp8_linear`.
"""

from __future__ import annotations

import torch

from ..quant import FP4_BLOCK
from ..registry import REGISTRY, Implementation
from ._checks import FLOAT_DTYPES, cuda_input_reason, need, need_dtype

REGISTRY.declare(
    "moe_gate",
    "x [T, D], weight [E, D], bias [E]/[T, E]/None, topk, route_scale, gate_temp -> "
    "(topk_weights [T, k] fp32, topk_ids [T, k] int64)",
)
REGISTRY.declare(
    "moe_experts",
    "x [T, D], topk weights/ids [T, k], FP4 w1/w3 [E, I, D/2], w2 [E, D, I/2] + scales -> [T, D]",
)

for _op in ("moe_gate", "moe_experts"):
    REGISTRY.register(Implementation(_op, "ref", f"deepinfer_kernels.ref.moe:{_op}"))
    REGISTRY.register(
        Implementation(
            _op,
            "triton",
            f"deepinfer_kernels.triton.moe:{_op}",
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("triton",),
            supports=f"deepinfer_kernels.ops.moe:{_op}_gpu_supports",
            routing=(
                "decode-sized routing (pairs <= 8 x experts): 16-row tiles; prefill: 64-row tiles"
                if _op == "moe_experts"
                else ""
            ),
        )
    )

REGISTRY.register(
    Implementation(
        "moe_experts",
        "cuda",
        "deepinfer_kernels.cuda.moe_decode:moe_experts",
        devices=("cuda",),
        min_capability=(9, 0),
        requires=("triton",),  # its routing, activation quantisation and combine kernels
        supports="deepinfer_kernels.ops.moe:moe_experts_cuda_supports",
        routing=(
            "bf16; auto mode up to 16 routed pairs per expert: mma.sync kernels fed by the TMA "
            "(8-token tiles up to 256 tokens, then 16; register-fed for unaligned weights), "
            "above: wgmma kernels on 128- or 160-token tiles, K permuted; batch-invariant "
            "mode: wgmma kernels with the Triton prefill tiles' bits on either weight order "
            "(128- or 160-token tiles above 8 pairs per expert)"
        ),
    )
)

GATE_MAX_EXPERTS = 1024
"""The Triton gate keeps all of a token's expert scores in registers (padded to a power of 2)."""


def moe_gate_gpu_supports(x: torch.Tensor, weight: torch.Tensor, *args: object, **kw: object):
    """Why the Triton gate cannot run these arguments, or None."""
    if weight.shape[0] > GATE_MAX_EXPERTS:
        return f"{weight.shape[0]} experts > {GATE_MAX_EXPERTS}"
    return cuda_input_reason(x)


def moe_experts_gpu_supports(
    x: torch.Tensor, *args: object, fragment_order: bool = False, **kw: object
) -> str | None:
    """Why the Triton experts cannot run these arguments, or None (scales must be UE8M0;
    fragment-order weights need D and I multiples of 128)."""
    for name, s in zip(("s1", "s3", "s2"), (args[3], args[5], args[7]), strict=True):
        if isinstance(s, torch.Tensor) and s.dtype != torch.float8_e8m0fnu:
            return f"{name} is {s.dtype}, the Triton experts read float8_e8m0fnu scales"
    w1 = args[2]
    if fragment_order and isinstance(w1, torch.Tensor) and (x.shape[1] % 128 or w1.shape[1] % 128):
        return (
            f"fragment-order weights need D and I multiples of 128, got {x.shape[1]}, {w1.shape[1]}"
        )
    return cuda_input_reason(x)


def moe_experts_cuda_supports(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor,
    s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
    *args: object, batch_invariant: bool = False, fragment_order: bool = False, **kw: object,
) -> str | None:  # fmt: skip
    """Why the cuda experts (`cuda/moe_decode.py`) cannot run these arguments, or None: bf16 with
    UE8M0 scales; any routing in auto mode (the TMA decode kernels, then the wgmma prefill
    kernels); batch-invariant mode: the wgmma kernels, whose dims must be multiples of 128;
    fragment-order weights: those kernels only."""
    from ..cuda.moe_decode import call_reason, default_config, order_reason

    why = order_reason(batch_invariant, None, fragment_order)
    if why is not None:
        return why
    cfg = default_config(batch_invariant, fragment_order, x, topk_ids, (w1, s1, w3, s3, w2, s2))
    weights = {"w1": w1, "w3": w3, "w2": w2}
    return call_reason(x, weights, {"s1": s1, "s3": s3, "s2": s2}, cfg)


def moe_fragment_order_pays(dim: int, inter: int, device: torch.device | str) -> bool:
    """Whether `moe_experts` runs faster here on expert weights in `quant.fp4_fragment_order`
    (pass `fragment_order=True`) than on the checkpoint's byte order, for experts of hidden size
    `dim` and intermediate size `inter`. True in batch-invariant mode when the cuda tier serves
    MoE on `device` (its wgmma kernels then skip a byte exchange per K step: on the H200 1.13-1.26x
    the auto kernels at T=1..64; at 8K tokens its prefill kernels 1.04-1.06x faster than with the
    exchange; NOTES.md, eleventh and fourteenth sessions). Elsewhere the checkpoint's order is as
    fast or faster: the mma.sync kernels read only it, the prefill kernels permute K instead, the
    ref tier un-permutes."""
    if not REGISTRY.batch_invariant or dim % 128 or inter % 128:
        return False
    device = torch.device(device)
    if device.type != "cuda":
        return False
    tiers = REGISTRY.tiers("moe_experts", device)
    return bool(tiers) and tiers[0] == "cuda"


def moe_gate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    route_scale: float,
    gate_temp: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens to experts.

    ``s = sqrt(softplus(x W^T / gate_temp))`` in fp32; ``ids = topk(s + bias)`` (bias [E] or
    [T, E] fp32, used only for choosing); ``weights = s[ids] / (sum s[ids] + 1e-20) * route_scale``.
    x [T, D], weight [E, D] -> (topk_weights [T, topk] fp32, topk_ids [T, topk] int64).
    """
    need_dtype(x, "x", *FLOAT_DTYPES)
    need(x.dim() == 2, f"x must be [T, D], got {list(x.shape)}")
    need(
        weight.dim() == 2 and weight.shape[1] == x.shape[1],
        f"weight must be [E, {x.shape[1]}], got {list(weight.shape)}",
    )
    e = weight.shape[0]
    need(1 <= topk <= e, f"topk must be in 1..{e}, got {topk}")
    need(gate_temp > 0, f"gate_temp must be > 0, got {gate_temp}")
    if bias is not None:
        need(
            list(bias.shape) in ([e], [x.shape[0], e]),
            f"bias must be [{e}] or [{x.shape[0]}, {e}], got {list(bias.shape)}",
        )
    return REGISTRY.call(
        "moe_gate",
        x,
        weight,
        bias,
        int(topk),
        float(route_scale),
        float(gate_temp),
        batch_invariant=REGISTRY.batch_invariant,
    )


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
    fragment_order: bool = False,
) -> torch.Tensor:
    """Routed FP4 experts, summed with their routing weights.

    For each (token, slot): ``W2 (swiglu(W1 x, W3 x) * weight)`` with V4.1's clamp (limit <= 0: no
    clamp); every linear quantises its input per 32 to FP8 (UE8M0) and expands FP4 e2m1 weights.
    x [T, D]; topk_weights [T, k] fp32; topk_ids [T, k] int64 (negative: not on this rank, skipped);
    w1, w3 [E, I, D/2] int8 with s1, s3 [E, I, D/32] e8m0; w2 [E, D, I/2] int8 with s2
    [E, D, I/32] e8m0 -> [T, D] x.dtype (expert outputs summed in fp32). fragment_order: w1, w3,
    w2 are in `quant.fp4_fragment_order` (K a multiple of 128: D and I), which lets
    batch-invariant mode's decode kernels skip a byte exchange per K step (the same results).
    """
    need_dtype(x, "x", *FLOAT_DTYPES)
    need(x.dim() == 2, f"x must be [T, D], got {list(x.shape)}")
    t, d = x.shape
    need(
        topk_ids.dim() == 2 and topk_ids.shape[0] == t,
        f"topk_ids must be [{t}, k], got {list(topk_ids.shape)}",
    )
    need(
        topk_weights.shape == topk_ids.shape,
        f"topk_weights must be {list(topk_ids.shape)}, got {list(topk_weights.shape)}",
    )
    need(
        topk_ids.dtype in (torch.int64, torch.int32),
        f"topk_ids must be int64/int32, got {topk_ids.dtype}",
    )
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        need_dtype(w, name, torch.int8)
    need(
        w1.dim() == 3 and w1.shape[2] * 2 == d and d % FP4_BLOCK == 0,
        f"w1 must be [E, I, {d // 2}] (D={d} a multiple of {FP4_BLOCK}), got {list(w1.shape)}",
    )
    e, i = w1.shape[0], w1.shape[1]
    need(i % FP4_BLOCK == 0, f"w1: I must be a multiple of {FP4_BLOCK}, got {i}")
    need(list(w3.shape) == [e, i, d // 2], f"w3 must be {[e, i, d // 2]}, got {list(w3.shape)}")
    need(list(w2.shape) == [e, d, i // 2], f"w2 must be {[e, d, i // 2]}, got {list(w2.shape)}")
    for name, s, want in (
        ("s1", s1, [e, i, d // 32]),
        ("s3", s3, [e, i, d // 32]),
        ("s2", s2, [e, d, i // 32]),
    ):
        need(list(s.shape) == want, f"{name} must be {want}, got {list(s.shape)}")
        need_dtype(s, name, torch.float8_e8m0fnu, torch.float32)
    need(
        not fragment_order or (d % 128 == 0 and i % 128 == 0),
        f"fragment-order weights need D and I multiples of 128, got D={d}, I={i}",
    )
    need(
        bool((topk_ids < e).all()) if topk_ids.numel() and not topk_ids.is_cuda else True,
        f"topk_ids must be < E={e}",
    )
    return REGISTRY.call(
        "moe_experts",
        x,
        topk_weights,
        topk_ids,
        w1,
        s1,
        w3,
        s3,
        w2,
        s2,
        float(swiglu_limit),
        batch_invariant=REGISTRY.batch_invariant,
        fragment_order=fragment_order,
    )
