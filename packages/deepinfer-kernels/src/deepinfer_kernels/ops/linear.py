"""Dense FP8 linear ops and the one place that decides which GEMM kernel runs a call.

`fp8_gemm`: activations already quantised (x_fp8 [M, K] e4m3 + per-32 fp32 scales) times a
32x32-block FP8 weight; `fp8_linear`: bf16/fp32 activations, quantised per 32 first. fp32 sums.

Tiers (`settings.TIERS` order, first that can run the call):
- `cuda`: the default on Hopper (sm_90a): a swap-AB decode kernel (`cuda/decode_gemm.py`) and a
  warp-specialised prefill kernel (`cuda/prefill_gemm.py`), both FP8 wgmma with per-32
  promotion, compiled by NVRTC at first use. Which of the two takes a call is `ROUTES` below.
- `triton`: the portable GPU tier (any CUDA GPU Triton supports with FP8 e4m3, and Hopper
  without NVRTC): a CUDA-core GEMV, a weight-streaming decode kernel and a tiled kernel.
- `ref`: pure torch in fp32, the numerics oracle (CPU).

`plan` turns (op, M, N, K, output dtype, mode, device) into the kernel and its config, once per
key (cached). Batch-invariant mode: every kernel a call can take splits K by (N, K) alone, so a
row's bits do not depend on M (the cuda decode and prefill kernels give the same bits).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..quant import FP8_BLOCK
from ..registry import REGISTRY, Implementation, device_capability, device_guard, sm_count
from ._checks import FLOAT_DTYPES, need_dtype

REGISTRY.declare(
    "fp8_gemm",
    "x_fp8 [M, K] e4m3, x_scale [M, K/32] fp32, w [N, K] e4m3, w_scale [N/32, K/32] e8m0 -> [M, N]",
    planner="deepinfer_kernels.ops.linear:gemm_tier",
)
REGISTRY.declare(
    "fp8_linear",
    "x [..., K] float, w [N, K] e4m3, w_scale [N/32, K/32] e8m0 -> [..., N] x.dtype",
    planner="deepinfer_kernels.ops.linear:linear_tier",
)
for _op in ("fp8_gemm", "fp8_linear"):
    REGISTRY.register(Implementation(_op, "ref", f"deepinfer_kernels.ref.linear:{_op}"))
    REGISTRY.register(
        Implementation(
            _op,
            "triton",
            f"deepinfer_kernels.triton.linear:{_op}",
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("triton",),
            routing="M = 1 (auto mode) CUDA-core GEMV; M <= 64 the decode kernel; else tiles",
        )
    )
    REGISTRY.register(
        Implementation(
            _op,
            "cuda",
            f"deepinfer_kernels.ops.linear:{_op}",  # composes the cuda kernels (`_run`)
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("triton",) if _op == "fp8_linear" else (),  # its activation quantiser
            routing="M <= 256 the decode kernel where ROUTES says, else the prefill kernel",
        )
    )


# ---- the routing table ----------------------------------------------------------------------

H200_SMS = 132
"""The SM count `ROUTES` was measured on; other devices take the rule (`cuda_kernel`)."""

ROUTE_M = (8, 16, 32, 48, 64, 96, 128, 192, 256)
"""M buckets of `ROUTES`: a call of M tokens takes the first bucket that holds M."""

ROUTES: dict[tuple[int, int], str] = {
    #               M <=  8  16  32  48  64  96 128 192 256
    (5120, 8192): "3 3 3 3 3 4p 2p 2 p",  # wo_b
    (32768, 1280): "2 2 2 2 2 p p 2 p",  # wq_b
    (1280, 5120): "3 3 3 3 3 4 3 4 .",  # wq_a
    (4608, 5120): "3 3 3 3 3 3 3 4 p",  # shared expert W1 + W3, fused
    (5120, 2304): "2 3 4 4 4 3 3 2 p",  # shared expert W2
    (2112, 7168): "2 3 4 3 3 3 3 4 p",  # V3's wq_a (the benchmark's shapes)
    (7168, 2048): "2 4 4 4 4 p p p p",
    (4096, 5120): "4 3 3 3 3 p p p p",
}
"""The cuda tier's measured routes for [N, K] weights on an H200 (`tools/bench_prefill.py
--routes`, `tools/bench_kernels.py --only decode`; PERF.md), one entry per `ROUTE_M` bucket: a
digit runs the decode kernel with that config in both modes (2: 128-row tiles at 2 CTAs per SM;
3 / 4: 64-row tiles at 3 / 4), `Dp` the prefill kernel in auto mode and the decode kernel with
config D in batch-invariant mode (where the prefill kernel's K split makes it the slower), `p`
the prefill kernel in both modes, `.` the decode kernel with its fill rule
(`decode_gemm.fill_config`)."""

DECODE_CONFIGS = {"2": (2, 2), "3": (1, 3), "4": (1, 4)}
"""`ROUTES` digit -> `DecodeGemmCudaConfig(consumers, min_blocks)`."""

CUDA_DECODE_MAX_M = 256
"""No call of more tokens runs the cuda decode kernel (each 64-token tile streams the weight)."""
CUDA_DECODE_RULE_M = 192
"""Weights not in `ROUTES`, auto mode: the decode kernel up to this many tokens, and up to
`CUDA_DECODE_MAX_M` for weights of fewer than `PREFILL_N` rows (the prefill kernel is short of
CTAs there); batch-invariant mode: up to `CUDA_DECODE_MAX_M` (both kernels give the same bits)."""
PREFILL_N = 2048

TRITON_GEMV_MAX_M = 1
"""Triton tier, auto mode: up to this many tokens on the CUDA-core GEMV (its fp32 sums run in
another order, so batch-invariant mode never takes it)."""
TRITON_DECODE_MAX_M = 64
"""Triton tier: up to this many tokens on the weight-streaming decode kernel, then tiles."""


def route_of(m: int, n: int, k: int, sms: int) -> str | None:
    """The `ROUTES` entry for M tokens on an [N, K] weight on `sms` SMs (None: not measured)."""
    row = ROUTES.get((n, k)) if sms == H200_SMS else None
    if row is None or m > ROUTE_M[-1]:
        return None
    return row.split()[next(i for i, top in enumerate(ROUTE_M) if m <= top)]


def cuda_kernel(m: int, n: int, k: int, batch_invariant: bool, sms: int = H200_SMS) -> str:
    """The cuda tier's kernel for M tokens on an [N, K] weight: "decode" or "prefill"."""
    if m > CUDA_DECODE_MAX_M:
        return "prefill"
    route = route_of(m, n, k, sms)
    if route is None:
        take = batch_invariant or m <= CUDA_DECODE_RULE_M or n < PREFILL_N
    else:
        take = route != "p" and (batch_invariant or not route.endswith("p"))
    return "decode" if take else "prefill"


def cuda_decode_config(m: int, n: int, k: int, sms: int = H200_SMS):
    """The decode kernel's config for M tokens on [N, K]: `ROUTES`' digit, else the fill rule.
    None of them changes a sum."""
    from ..cuda import decode_gemm

    route = route_of(m, n, k, sms)
    if route is not None and route[0] in DECODE_CONFIGS:
        return decode_gemm.DecodeGemmCudaConfig(*DECODE_CONFIGS[route[0]])
    return decode_gemm.fill_config(m, n, k, sms)


# ---- plans ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmPlan:
    """How one GEMM call runs: `tier`, its `kernel` ("decode", "prefill", "gemv", "tiles", "ref")
    and the kernel's `config` (None for ref)."""

    tier: str
    kernel: str
    config: Any = None

    def __str__(self) -> str:
        return f"{self.tier}.{self.kernel}" + (f" {self.config}" if self.config else "")


def cuda_plan(op, m, n, k, out_dtype, batch_invariant, sms) -> GemmPlan | str:
    from ..cuda import decode_gemm, module, prefill_gemm

    if out_dtype not in (torch.bfloat16, torch.float32):
        return f"out_dtype {out_dtype}: the cuda GEMM writes bfloat16 or float32"
    if cuda_kernel(m, n, k, batch_invariant, sms) == "decode":
        cfg = cuda_decode_config(m, n, k, sms)
        why = decode_gemm.shape_reason(n, k, m, cfg, sms)
        plan = GemmPlan("cuda", "decode", cfg)
    else:
        cfg = prefill_gemm.call_config(m, n, k, batch_invariant, sms)
        why = prefill_gemm.shape_reason(n, k, cfg)
        plan = GemmPlan("cuda", "prefill", cfg)
    return why or module.nvrtc_reason() or plan


def triton_plan(op, m, n, k, batch_invariant) -> GemmPlan:
    from ..triton import gemv, linear

    if m <= TRITON_GEMV_MAX_M and not batch_invariant:
        return GemmPlan("triton", "gemv", gemv.gemv_config(n, k))
    if m <= TRITON_DECODE_MAX_M:
        return GemmPlan("triton", "decode", linear.decode_config(m, n, k, batch_invariant))
    a_bf16 = op == "fp8_linear"  # fp8_linear hands the tiles bf16-expanded activations
    return GemmPlan("triton", "tiles", linear.tile_config(m, n, k, batch_invariant, a_bf16))


@functools.lru_cache(maxsize=8192)
def plan(
    op: str,
    m: int,
    n: int,
    k: int,
    out_dtype: torch.dtype,
    batch_invariant: bool,
    capability: tuple[int, int] | None,
    sms: int,
    tiers: tuple[str, ...],
) -> tuple[tuple[GemmPlan, ...], tuple[str, ...]]:
    """The plans of an `op` call ("fp8_gemm" or "fp8_linear") of M rows on an [N, K] weight
    writing `out_dtype`, best first, among `tiers` (those the device and the overrides allow,
    `REGISTRY.tiers`), and why each other tier was passed over. A call runs the first plan whose
    tier takes its operands' layout (`_operand_reason`)."""
    plans, passed = [], []
    for tier in tiers:
        if tier == "cuda":
            if capability != (9, 0):
                passed.append("cuda: needs sm_90a (Hopper wgmma)")
                continue
            found = cuda_plan(op, m, n, k, out_dtype, batch_invariant, sms)
        elif tier == "triton":
            found = triton_plan(op, m, n, k, batch_invariant)
        elif tier == "ref":
            found = GemmPlan("ref", "ref")
        else:
            found = f"no {tier} kernel"
        if isinstance(found, str):
            passed.append(f"{tier}: {found}")
        else:
            plans.append(found)
    return tuple(plans), tuple(passed)


def _operand_reason(p: GemmPlan, op: str, args: tuple) -> str | None:
    """Why `p`'s kernel cannot take these operands (layout, alignment), or None."""
    if p.tier != "cuda":
        return None
    from ..cuda import module

    if op == "fp8_gemm":
        return module.operand_reason(*args)
    _, w, w_scale = args
    for name, t in (("w", w), ("w_scale", w_scale)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} must be contiguous and 16-byte aligned (the TMA copies it)"
    if w_scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        return f"w_scale is {w_scale.dtype}, the cuda GEMM reads float8_e8m0fnu or float32"
    return None


def _cuda_gemm(p: GemmPlan, x_fp8, x_scale, w, w_scale, out_dtype) -> torch.Tensor:
    from ..cuda import decode_gemm, prefill_gemm

    if p.kernel == "decode":
        return decode_gemm.decode_gemm(x_fp8, x_scale, w, w_scale, out_dtype, config=p.config)
    return prefill_gemm.fp8_gemm(x_fp8, x_scale, w, w_scale, out_dtype, config=p.config)


def _run(p: GemmPlan, op: str, args: tuple, batch_invariant: bool) -> torch.Tensor:
    if p.tier == "ref":
        from ..ref import linear as ref_linear

        return getattr(ref_linear, op)(*args, batch_invariant=batch_invariant)
    if p.tier == "triton":
        from ..triton import linear as triton_linear

        fn = getattr(triton_linear, op)
        return fn(*args, batch_invariant=batch_invariant, config=p.config)
    if op == "fp8_gemm":
        return _cuda_gemm(p, *args)
    x, w, w_scale = args
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = REGISTRY.call("act_quant_fp8", x2)
    y = _cuda_gemm(p, xq, xs, w, w_scale, x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def plans_for(op: str, m: int, args: tuple, device: torch.device) -> tuple[GemmPlan, ...]:
    """`plan` for a call of `op` with these arguments (M rows, weight args[-2] [N, K]) on
    `device`, under the current settings."""
    w = args[2] if op == "fp8_gemm" else args[1]
    out_dtype = args[4] if op == "fp8_gemm" else args[0].dtype
    tiers = tuple(REGISTRY.tiers(op, device))
    found, _ = plan(
        op, m, w.shape[0], w.shape[1], out_dtype, REGISTRY.batch_invariant,
        device_capability(device), sm_count(device), tiers,
    )  # fmt: skip
    return found


def _chosen(op: str, m: int, args: tuple) -> GemmPlan:
    """The plan a call runs: the first whose tier takes its operands."""
    device = args[0].device
    reasons = []
    for p in plans_for(op, m, args, device):
        why = _operand_reason(p, op, args)
        if why is None:
            return p
        reasons.append(f"{p.tier}: {why}")
    raise NotImplementedError(
        f"no implementation of {op!r} runs these arguments on {device}: "
        + ("; ".join(reasons) or "no tier is available on this device")
    )


def _dispatch(op: str, m: int, args: tuple) -> torch.Tensor:
    p = _chosen(op, m, args)
    with device_guard(args[0].device):
        return _run(p, op, args, REGISTRY.batch_invariant)


def gemm_tier(x_fp8, x_scale, w, w_scale, out_dtype=torch.bfloat16, **kw: Any) -> str:
    """The tier an `fp8_gemm` call runs on (`REGISTRY.resolve`; batch_invariant=: that mode)."""
    args = (x_fp8, x_scale, w, w_scale, out_dtype)
    with _mode(kw.get("batch_invariant")):
        return _chosen("fp8_gemm", x_fp8.shape[0], args).tier


def linear_tier(x, w, w_scale, **kw: Any) -> str:
    """The tier an `fp8_linear` call runs on (`REGISTRY.resolve`; batch_invariant=: that mode)."""
    with _mode(kw.get("batch_invariant")):
        return _chosen("fp8_linear", x.numel() // x.shape[-1], (x, w, w_scale)).tier


def _mode(batch_invariant: bool | None):
    """A block in batch-invariant mode `batch_invariant` (None: the current settings)."""
    if batch_invariant is None:
        return contextlib.nullcontext()
    return REGISTRY.batch_invariant_mode(batch_invariant)


def run_on(tier: str, op: str, *args: Any) -> torch.Tensor:
    """`op` ("fp8_gemm" / "fp8_linear") on `tier` with the plan it has for this call, under the
    current settings, whatever the tiers before it would take (tests, benchmarks)."""
    x = args[0]
    m = x.numel() // x.shape[-1] if op == "fp8_linear" else x.shape[0]
    found = [p for p in plans_for(op, m, args, x.device) if p.tier == tier]
    if not found:
        raise ValueError(f"{op}: tier {tier!r} has no plan for this call here")
    return _run(found[0], op, args, REGISTRY.batch_invariant)


# ---- the ops ----------------------------------------------------------------------------------
# Their checks run on every call (eager prefill, graph capture): messages are built only when a
# check fails.


def _check_weight(w: torch.Tensor, w_scale: torch.Tensor, k: int) -> None:
    need_dtype(w, "w", torch.float8_e4m3fn)
    if not (w.dim() == 2 and w.shape[1] == k):
        raise ValueError(f"w must be [N, {k}], got {list(w.shape)}")
    want = (-(-w.shape[0] // FP8_BLOCK), -(-k // FP8_BLOCK))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"w_scale must be {list(want)}, got {list(w_scale.shape)}")
    need_dtype(w_scale, "w_scale", torch.float8_e8m0fnu, torch.float32)


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w * w_scale)^T`` with fp32 accumulation.

    x_fp8 [M, K] e4m3 (K % 32 == 0), x_scale [M, K/32] fp32 powers of two, w [N, K] e4m3,
    w_scale [ceil(N/32), K/32] e8m0 (or fp32 powers of two) -> [M, N] out_dtype.
    """
    need_dtype(x_fp8, "x_fp8", torch.float8_e4m3fn)
    if x_fp8.dim() != 2:
        raise ValueError(f"x_fp8 must be [M, K], got {list(x_fp8.shape)}")
    m, k = x_fp8.shape
    if k % FP8_BLOCK:
        raise ValueError(f"x_fp8: K must be a multiple of {FP8_BLOCK}, got {k}")
    if tuple(x_scale.shape) != (m, k // FP8_BLOCK) or x_scale.dtype != torch.float32:
        raise ValueError(
            f"x_scale must be [{m}, {k // FP8_BLOCK}] fp32, got {list(x_scale.shape)} "
            f"{x_scale.dtype}"
        )
    _check_weight(w, w_scale, k)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    return _dispatch("fp8_gemm", m, (x_fp8, x_scale, w, w_scale, out_dtype))


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32, K % 32 == 0) -> [..., N] x.dtype.

    x is quantised per 32 channels to FP8 e4m3 with UE8M0 scales (as the reference), multiplied by
    the block-scaled FP8 weight w [N, K] / w_scale [ceil(N/32), K/32] with fp32 accumulation.
    """
    need_dtype(x, "x", *FLOAT_DTYPES)
    k = x.shape[-1]
    if k % FP8_BLOCK:
        raise ValueError(f"x: last dimension must be a multiple of {FP8_BLOCK}, got {k}")
    _check_weight(w, w_scale, k)
    return _dispatch("fp8_linear", x.numel() // k if k else 0, (x, w, w_scale))
