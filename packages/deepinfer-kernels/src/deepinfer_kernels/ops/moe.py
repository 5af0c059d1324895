"""MoE ops: the router gate (sqrt-softplus + bias, top-k, normalised weights x route_scale) and the
routed FP4 experts (permute, W1/W3, clamped SwiGLU x routing weight, W2, weighted combine).

The shared expert is not here: it is a dense FP8 MLP the model computes with `ops.fp8_linear`.

Tiers: `moe_experts` runs the `cuda` tier on Hopper (sm_90a mma.sync and wgmma kernels, the
fastest measured at every size) and the `triton` tier elsewhere (the portable GPU tier: any CUDA
GPU Triton supports with FP8); `moe_gate` runs `triton`; `ref` (torch) defines the numerics and
runs on CPU. Which cuda kernels and which tiles a call takes is decided here (`plan`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..quant import FP4_BLOCK
from ..registry import REGISTRY, Implementation, device_capability, device_guard
from ._checks import FLOAT_DTYPES, cuda_input_reason, need, need_dtype

REGISTRY.declare(
    "moe_gate",
    "x [T, D], weight [E, D], bias [E]/[T, E]/None, topk, route_scale, gate_temp -> "
    "(topk_weights [T, k] fp32, topk_ids [T, k] int64)",
)
REGISTRY.declare(
    "moe_experts",
    "x [T, D], topk weights/ids [T, k], FP4 w1/w3 [E, I, D/2], w2 [E, D, I/2] + scales -> [T, D]",
    planner="deepinfer_kernels.ops.moe:experts_tier",
)

REGISTRY.register(Implementation("moe_gate", "ref", "deepinfer_kernels.ref.moe:moe_gate"))
REGISTRY.register(
    Implementation(
        "moe_gate",
        "triton",
        "deepinfer_kernels.triton.moe:moe_gate",
        devices=("cuda",),
        min_capability=(9, 0),
        requires=("triton",),
        supports="deepinfer_kernels.ops.moe:moe_gate_gpu_supports",
    )
)
REGISTRY.register(Implementation("moe_experts", "ref", "deepinfer_kernels.ref.moe:moe_experts"))
REGISTRY.register(
    Implementation(
        "moe_experts",
        "triton",
        "deepinfer_kernels.triton.moe:moe_experts",
        devices=("cuda",),
        min_capability=(9, 0),
        requires=("triton",),
        routing="16-row tiles up to 8 routed pairs per expert, else 64-row tiles",
    )
)
REGISTRY.register(
    Implementation(
        "moe_experts",
        "cuda",
        "deepinfer_kernels.ops.moe:cuda_moe_experts",  # the cuda GEMMs between Triton routing
        devices=("cuda",),
        min_capability=(9, 0),
        requires=("triton",),  # its routing, activation quantisation and combine kernels
        routing=(
            "auto mode: mma.sync kernels fed by the TMA up to 16 routed pairs per expert (8-token "
            "tiles up to 256 tokens, then 16), above wgmma kernels on 128- or 160-token tiles, K "
            "permuted; batch-invariant mode: wgmma kernels with the Triton prefill tiles' bits"
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


# ---- the routing table ----------------------------------------------------------------------

E8M0 = torch.float8_e8m0fnu

PREFILL_PAIRS_PER_EXPERT = 8
"""Routing with more (token, slot) pairs per expert than this is prefill-sized: the Triton tier's
64-row tiles, and batch-invariant mode's switch from the cuda decode to the prefill kernels (the
same bits either side)."""
CUDA_PREFILL_PAIRS_PER_EXPERT = 16
"""Auto mode: the cuda tier runs its TMA decode kernels up to this many pairs per expert, above
it the wgmma prefill kernels (PERF.md)."""
CUDA_TILE8_TOKENS = 256
"""Auto mode: the TMA decode kernels on 8-token routing tiles up to this many tokens, then 16."""


def wide_tiles_pay(pairs_per_expert: float) -> bool:
    """Whether the cuda prefill kernels run faster on 160-token routing tiles than on 128 for this
    many pairs per expert: each tile is one pass over its expert's weights, and an expert with the
    mean plus two standard deviations of uniform routing (m + 2 sqrt(m) pairs) takes fewer wide
    tiles (PERF.md)."""
    import math

    from ..cuda.moe import WIDE_TILE_TOKENS

    reach = pairs_per_expert + 2.0 * math.sqrt(max(pairs_per_expert, 0.0))
    return math.ceil(reach / WIDE_TILE_TOKENS) < math.ceil(reach / 128)


def cuda_config(
    batch_invariant: bool, fragment_order: bool, tokens: int, pairs: int, experts: int,
    aligned: bool = True,
):  # fmt: skip
    """The cuda tier's kernels and config for `pairs` routed pairs of `tokens` tokens over
    `experts` experts (aligned: the weights and scales start on 16 bytes, as the TMA and wgmma
    kernels need): prefill-sized routing the wgmma prefill kernels (160-token tiles where
    `wide_tiles_pay`), else the decode kernels (wgmma in batch-invariant mode or on
    fragment-order weights, else mma.sync fed by the TMA, by registers for unaligned weights)."""
    from ..cuda import moe as cuda_moe

    per_expert = PREFILL_PAIRS_PER_EXPERT if batch_invariant else CUDA_PREFILL_PAIRS_PER_EXPERT
    if pairs > per_expert * experts:
        if fragment_order:
            cfg = cuda_moe.WGMMA_PREFILL_FRAGMENT
        elif batch_invariant:
            cfg = cuda_moe.WGMMA_PREFILL_EXCHANGE
        else:
            cfg = cuda_moe.WGMMA_PREFILL
        return cuda_moe.wide_tiles(cfg) if wide_tiles_pay(pairs / experts) else cfg
    if fragment_order:
        return cuda_moe.WGMMA_FRAGMENT
    if batch_invariant:
        return cuda_moe.WGMMA_DEFAULT
    if not aligned:
        return cuda_moe.REGISTER
    return cuda_moe.TMA if tokens <= CUDA_TILE8_TOKENS else cuda_moe.TMA_TILE16


def triton_config(pairs: int, experts: int, batch_invariant: bool, fragment_order: bool):
    """The Triton tier's tiles: 16-row tiles at decode sizes (wgmma in batch-invariant mode, whose
    rows are those of the 64-row prefill tiles), 64-row tiles for prefill-sized routing."""
    from dataclasses import replace

    from ..triton import moe as triton_moe

    if pairs > PREFILL_PAIRS_PER_EXPERT * experts:
        return triton_moe.PREFILL_FRAGMENT if fragment_order else triton_moe.PREFILL
    cfg = triton_moe.DECODE_WGMMA if batch_invariant else triton_moe.DECODE
    return replace(cfg, fragment_weights=True) if fragment_order else cfg


@dataclass(frozen=True)
class MoePlan:
    """How one routed-experts call runs: `tier` and its kernels' `config` (None for ref)."""

    tier: str
    config: Any = None

    def __str__(self) -> str:
        return self.tier + (f" {self.config}" if self.config is not None else "")


@functools.lru_cache(maxsize=4096)
def plan(
    tokens: int, topk: int, experts: int, d: int, i: int, x_dtype: torch.dtype,
    scale_dtypes: tuple[torch.dtype, ...], aligned: bool, batch_invariant: bool,
    fragment_order: bool, capability: tuple[int, int] | None, tiers: tuple[str, ...],
) -> tuple[tuple[MoePlan, ...], tuple[str, ...]]:  # fmt: skip
    """The plans of a `moe_experts` call, best first, among `tiers` (`REGISTRY.tiers`), and why
    each other tier was passed over. scale_dtypes: of s1, s3, s2; aligned: every weight and scale
    starts on 16 bytes."""
    pairs = tokens * topk
    bad = [(n, t) for n, t in zip(("s1", "s3", "s2"), scale_dtypes, strict=True) if t != E8M0]
    bad_scale = f"{bad[0][0]} is {bad[0][1]}" if bad else None
    plans, passed = [], []
    for tier in tiers:
        why = None
        if tier == "cuda":
            from ..cuda import module
            from ..cuda import moe as cuda_moe

            if capability != (9, 0):
                why = "needs sm_90a (Hopper)"
            elif fragment_order and not batch_invariant:
                why = "fragment-order weights: the mma.sync kernels read the checkpoint's order"
            elif x_dtype != torch.bfloat16:
                why = f"x is {x_dtype}, the cuda experts take bfloat16"
            elif bad_scale:
                why = f"{bad_scale}, the cuda experts read float8_e8m0fnu scales"
            else:
                cfg = cuda_config(batch_invariant, fragment_order, tokens, pairs, experts, aligned)
                needs_aligned = isinstance(cfg, cuda_moe.MoeDecodeWgmmaConfig) or cfg.tma
                why = (
                    "the weights are not 16-byte aligned" if needs_aligned and not aligned else None
                )
                why = why or cuda_moe.shape_reason(d, i, cfg) or module.nvrtc_reason()
                found = MoePlan("cuda", cfg)
        elif tier == "triton":
            if bad_scale:
                why = f"{bad_scale}, the Triton experts read float8_e8m0fnu scales"
            elif fragment_order and (d % 128 or i % 128):
                why = f"fragment-order weights need D and I multiples of 128, got {d}, {i}"
            found = MoePlan(
                "triton", triton_config(pairs, experts, batch_invariant, fragment_order)
            )
        elif tier == "ref":
            found = MoePlan("ref")
        else:
            why = f"no {tier} kernels"
        if why is None:
            plans.append(found)
        else:
            passed.append(f"{tier}: {why}")
    return tuple(plans), tuple(passed)


def _plans(args: tuple, batch_invariant: bool, fragment_order: bool) -> tuple[MoePlan, ...]:
    x, _, ids, w1, s1, w3, s3, w2, s2 = args[:9]
    scale_dtypes = (s1.dtype, s3.dtype, s2.dtype)
    aligned = all(t.data_ptr() % 16 == 0 for t in (w1, s1, w3, s3, w2, s2))
    found, _ = plan(
        x.shape[0], ids.shape[1], w1.shape[0], x.shape[1], w1.shape[1], x.dtype, scale_dtypes,
        aligned, batch_invariant, fragment_order, device_capability(x.device),
        tuple(REGISTRY.tiers("moe_experts", x.device)),
    )  # fmt: skip
    if not found:
        raise NotImplementedError("no implementation of 'moe_experts' runs these arguments here")
    return found


def experts_tier(
    *args: Any, batch_invariant: bool | None = None, fragment_order: bool = False, **_: Any
) -> str:
    """The tier a `moe_experts` call runs on (`REGISTRY.resolve`; batch_invariant None: the
    current settings' mode)."""
    bi = REGISTRY.batch_invariant if batch_invariant is None else batch_invariant
    return _plans(args, bi, fragment_order)[0].tier


def cuda_moe_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor,
    s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
    swiglu_limit: float, *, config=None, batch_invariant: bool = False,
    fragment_order: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The cuda tier's routed experts with `config` (None: `cuda_config`'s): the Triton tier
    routes the pairs into the config's tiles and quantises the activations, the cuda kernels run
    W1/W3 and W2 (`cuda.moe.expert_gemms`), the Triton tier combines. Contract of `moe_experts`;
    batch_invariant: the call must keep the prefill tiles' sums (wgmma configs, K in order).
    ValueError naming the problem when the kernels cannot take the call."""
    from ..cuda import moe as cuda_moe
    from ..triton import moe as triton_moe
    from ..triton import quant as triton_quant

    why = cuda_moe.order_reason(batch_invariant, config, fragment_order)
    if why is not None:
        raise ValueError(f"cuda moe_experts: {why}")
    t, e = x.shape[0], w1.shape[0]
    w1, s1, w3, s3, w2, s2 = (v.contiguous() for v in (w1, s1, w3, s3, w2, s2))
    if config is None:
        aligned = cuda_moe.aligned(w1, s1, w3, s3, w2, s2)
        config = cuda_config(batch_invariant, fragment_order, t, topk_ids.numel(), e, aligned)
    names = {"w1": w1, "w3": w3, "w2": w2}
    why = cuda_moe.call_reason(x, names, {"s1": s1, "s3": s3, "s2": s2}, config)
    if why is not None:
        raise ValueError(f"cuda moe_experts: {why}")
    out = torch.empty_like(x)
    if t == 0 or topk_ids.shape[1] == 0:
        return out.zero_()
    route = triton_moe.build_routing(topk_weights, topk_ids, e, config.tile_tokens)
    # permuted K: the columns in the order the kernels sum K (W1/W3 write h in that order);
    # x_tma: the routed rows in tile order, for the TMA boxes
    x_tma = getattr(config, "x_tma", False)
    permuted = getattr(config, "permuted_k", False)
    xa = triton_quant.act_fake_quant_bf16(x, route.sorted_token if x_tma else None, permuted)
    y = cuda_moe.expert_gemms(
        xa, route.sorted_token, route.sorted_weight, route.tiles, w1, s1, w3, s3, w2, s2, t,
        swiglu_limit, config,
    )  # fmt: skip
    return triton_moe.combine(y, route, out)


def triton_moe_experts(
    *args: Any, config=None, batch_invariant: bool = False, fragment_order: bool = False
) -> torch.Tensor:
    """The Triton tier's routed experts with `config` (None: `triton_config`'s); contract of
    `moe_experts`."""
    from ..triton import moe as triton_moe

    if config is None:
        ids, w1 = args[2], args[3]
        config = triton_config(ids.numel(), w1.shape[0], batch_invariant, fragment_order)
    return triton_moe.moe_experts(*args, config=config, fragment_order=fragment_order)


def _run(p: MoePlan, args: tuple, batch_invariant: bool, fragment_order: bool) -> torch.Tensor:
    kw = dict(batch_invariant=batch_invariant, fragment_order=fragment_order)
    if p.tier == "cuda":
        return cuda_moe_experts(*args, config=p.config, **kw)
    if p.tier == "triton":
        return triton_moe_experts(*args, config=p.config, **kw)
    from ..ref import moe as ref_moe

    return ref_moe.moe_experts(*args, **kw)


def moe_fragment_order_pays(dim: int, inter: int, device: torch.device | str) -> bool:
    """Whether `moe_experts` runs faster here on expert weights in `quant.fp4_fragment_order`
    (pass `fragment_order=True`) than on the checkpoint's byte order, for experts of hidden size
    `dim` and intermediate size `inter`. True in batch-invariant mode when the cuda tier serves
    MoE on `device` (its wgmma kernels then skip a byte exchange per K step; PERF.md). Elsewhere
    the checkpoint's order is as fast or faster: the mma.sync kernels read only it, the prefill
    kernels permute K instead, the ref tier un-permutes."""
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
    args = (x, topk_weights, topk_ids, w1, s1, w3, s3, w2, s2, float(swiglu_limit))
    bi = REGISTRY.batch_invariant
    with device_guard(x.device):
        return _run(_plans(args, bi, fragment_order)[0], args, bi, fragment_order)
