"""Routed FP4 experts at decode sizes (T <= 8 tokens) on FP8 wgmma (`moe_decode_fp8.cu`): the
dense decode GEMM's swap-AB structure (`decode_gemm.cu`) with the FP4 weights expanded exactly to
e4m3 in registers as the wgmma's A operand, instead of mma.sync on bf16 (`moe_decode.cu`), whose
expansion and K loop take ~3 instructions per weight value.

Numerics: the contract of `ref.moe.moe_experts` (activations quantised per 32 to FP8, FP4
weights exact, fp32 sums; gate/up rounded to bf16, clamped SwiGLU x routing weight rounded to
bf16 and quantised per 32 to FP8 for W2; each routed row's W2 output rounded to bf16; rows summed
per token in routing order), summed per k32 slice by the tensor cores and promoted with the
slice's scales (decode_gemm.py's arithmetic): other fp32 bits than the mma.sync kernels'.

Routing (`triton.moe.build_routing`, 8-row tiles: one per routed expert at T <= 8), the
activation quantisation and the combine are the Triton tier's kernels. Compiled by NVRTC at
first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ..quant import ACT_AMAX_FLOOR
from . import module
from .module import check_fields

SOURCE = Path(__file__).with_name("moe_decode_fp8.cu")
ARCH = "sm_90a"
MAX_TOKENS = 8  # the wgmma's N: every token of the call is a column of W1/W3
BLOCK_K = 128  # K values per ring stage
STAGE_BYTES = 10 * 1024  # two 64-row x 64-byte weight boxes, the token box, their scales
THREADS = 384  # a producer warpgroup and two consumer warpgroups
PRODUCER_REGS = 40  # moe_decode_fp8.cu: the four boxes per stage spill at 24
REGS_PER_SM = 65536
SM_SHARED = 228 * 1024
STATIC_SHARED = 256  # the ring's barriers
ROWS = {1: 64, 2: 128}  # an expert's weight rows per CTA: W1/W3 (and as many W3 rows), W2


@dataclass(frozen=True)
class MoeDecodeFp8Config:
    """split1 / split2: K chunks of W1/W3 (K = hidden) and W2 (K = intermediate), the CTAs of a
    cluster, summed in chunk order; min_blocks: CTAs per SM the registers and the ring are cut
    for; stages: ring stages (0: as many as fit). The fp32 sums depend on the splits only."""

    split1: int = 1
    split2: int = 1
    min_blocks: int = 2
    stages: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("split1", self.split1 in (1, 2, 4, 8), "1, 2, 4 or 8"),
            ("split2", self.split2 in (1, 2, 4, 8), "1, 2, 4 or 8"),
            ("min_blocks", 1 <= self.min_blocks <= 3, "1..3"),
            ("stages", self.stages == 0 or 2 <= self.stages <= 16, "0 (auto) or 2..16"),
        )
        check_fields(self, checks)


DEFAULT = MoeDecodeFp8Config()


def _kind_dims(kind: int, d: int, i: int, cfg: MoeDecodeFp8Config) -> tuple[int, int, int]:
    """(K, weight rows per expert, K split) of W1/W3 (kind 1) or W2 (kind 2)."""
    return (d, i, cfg.split1) if kind == 1 else (i, d, cfg.split2)


def table_bytes(kind: int, d: int, i: int, cfg: MoeDecodeFp8Config) -> int:
    """The chunk's weight scale bytes: [128 rows][K / split / 32]."""
    k, _, split = _kind_dims(kind, d, i, cfg)
    return k // split // 32 * 128


def stages_for(kind: int, d: int, i: int, cfg: MoeDecodeFp8Config) -> int:
    """cfg.stages, or as many as `min_blocks` CTAs per SM leave room for (at most 16)."""
    if cfg.stages:
        return cfg.stages
    per_cta = min(SM_SHARED // cfg.min_blocks - 1024, module.MAX_SHARED)
    free = per_cta - STATIC_SHARED - 1024 - table_bytes(kind, d, i, cfg)
    return max(0, min(16, free // STAGE_BYTES))


def shared_bytes(kind: int, d: int, i: int, cfg: MoeDecodeFp8Config) -> int:
    return stages_for(kind, d, i, cfg) * STAGE_BYTES + table_bytes(kind, d, i, cfg) + 1024


def consumer_regs(cfg: MoeDecodeFp8Config) -> int:
    """Registers per consumer thread after setmaxnreg (a multiple of 8, at most 240)."""
    launch = min(255, REGS_PER_SM // (THREADS * cfg.min_blocks)) // 8 * 8
    return min(240, (launch * THREADS - PRODUCER_REGS * 128) // 256 // 8 * 8)


@functools.lru_cache(maxsize=256)
def shape_reason(d: int, i: int, cfg: MoeDecodeFp8Config = DEFAULT) -> str | None:
    """Why the kernels cannot take hidden size d and intermediate size i with this config, or
    None: each K a multiple of 128 per chunk, at least 2 stages within a CTA's shared memory."""
    for kind, name in ((1, "W1/W3"), (2, "W2")):
        # (whole stages per chunk also make whole row tiles: W1/W3's rows are W2's K, W2's W1/W3's)
        k, _, split = _kind_dims(kind, d, i, cfg)
        if k <= 0 or k % (BLOCK_K * split):
            return f"{name}: K={k} must be a positive multiple of {BLOCK_K} x split {split}"
        if stages_for(kind, d, i, cfg) < 2:
            return f"{name}: fewer than 2 stages fit with {cfg.min_blocks} CTAs per SM"
        if shared_bytes(kind, d, i, cfg) > module.MAX_SHARED - STATIC_SHARED:
            return f"{name}: the ring and scales need more shared memory than a CTA may take"
    if consumer_regs(cfg) < 56:
        return f"{consumer_regs(cfg)} registers per consumer thread at {cfg.min_blocks} per SM"
    return None


def call_reason(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    cfg: MoeDecodeFp8Config = DEFAULT,
) -> str | None:
    """Why `moe_experts` cannot run this call here, or None: at most 8 tokens, bf16 x, the
    weights contiguous int8 / uint8 stacks at 16-byte aligned addresses (the TMA's), the
    shapes, a GPU with NVRTC."""
    w1, s1, w3, s3, w2, s2 = weights
    t, d = x.shape
    if t > MAX_TOKENS:
        return f"{t} tokens: at most {MAX_TOKENS}"
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}, not bfloat16"
    e, i = w1.shape[0], w1.shape[1]
    shapes = {
        "w1": (w1, (e, i, d // 2)), "w3": (w3, (e, i, d // 2)), "w2": (w2, (e, d, i // 2)),
        "s1": (s1, (e, i, d // 32)), "s3": (s3, (e, i, d // 32)), "s2": (s2, (e, d, i // 32)),
    }  # fmt: skip
    for name, (v, shape) in shapes.items():
        if tuple(v.shape) != shape:
            return f"{name} has shape {list(v.shape)}, expected {list(shape)}"
        if v.element_size() != 1 or not v.is_contiguous() or v.data_ptr() % 16:
            return f"{name} must be a contiguous 1-byte tensor at a 16-byte aligned address"
    if topk_ids.shape[0] != t:
        return f"topk_ids has {topk_ids.shape[0]} rows for {t} tokens"
    why = shape_reason(d, i, cfg)
    return why or module.launch_reason(x)


def defines(kind: int, d: int, i: int, cfg: MoeDecodeFp8Config) -> dict[str, int]:
    """The kernel's compile-time constants."""
    return dict(
        KIND=kind, D_DIM=d, I_DIM=i, SPLIT=_kind_dims(kind, d, i, cfg)[2],
        STAGES=stages_for(kind, d, i, cfg), MIN_BLOCKS=cfg.min_blocks,
        CONSUMER_REGS=consumer_regs(cfg),
    )  # fmt: skip


@functools.cache
def cubin(kind: int, d: int, i: int, cfg: MoeDecodeFp8Config) -> bytes:
    return module.compile_file(SOURCE, ARCH, defines(kind, d, i, cfg))


@functools.cache
def _kernel(kind: int, d: int, i: int, cfg: MoeDecodeFp8Config, device: int) -> module.Kernel:
    return module.load_kernel(
        cubin(kind, d, i, cfg),
        "moe_decode_fp8",
        torch.device("cuda", device),
        shared_bytes(kind, d, i, cfg),
    )


def _weight_map(w: torch.Tensor) -> module.TensorMap:
    """An expert stack [E, N, K/2] as E * N rows of K/2 bytes, 64-row x 64-byte boxes (128 FP4
    values, one stage) with the 64-byte swizzle."""
    return module.tensor_map_2d(
        w.data_ptr(), w.shape[0] * w.shape[1], w.shape[2], 64, 64, swizzle_64b=True
    )


def _token_maps(q: torch.Tensor, s: torch.Tensor) -> tuple[module.TensorMap, module.TensorMap]:
    """e4m3 rows q [R, K] as 8-row x 128-byte boxes (the wgmma's 128-byte swizzle) and their
    scales s [R, K / 32] fp32 as 8-row x 4-float boxes."""
    rows, k = q.shape
    return (
        module.tensor_map_2d(q.data_ptr(), rows, k, BLOCK_K, MAX_TOKENS, swizzle_128b=True),
        module.tensor_map_2d(s.data_ptr(), rows, k // 32 * 4, 16, MAX_TOKENS),
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
    config: MoeDecodeFp8Config | None = None,
) -> torch.Tensor:
    """Routed FP4 experts for T <= 8 tokens (see the module docstring). x [T, D] bf16;
    topk_weights [T, k] fp32; topk_ids [T, k] (< 0: skipped); w1/w3 [E, I, D/2] int8 + s1/s3
    [E, I, D/32] e8m0 bytes; w2 [E, D, I/2] + s2 [E, D, I/32] -> [T, D] bf16. ValueError naming
    the problem when `call_reason` refuses the call."""
    from ..triton.moe import build_routing, combine
    from ..triton.quant import act_quant_fp8

    cfg = config or DEFAULT
    ws = (w1, s1, w3, s3, w2, s2)
    why = call_reason(x, topk_ids, ws, cfg)
    if why is not None:
        raise ValueError(f"cuda moe_experts (fp8 decode): {why}")
    t, d = x.shape
    e, i = w1.shape[0], w1.shape[1]
    out = torch.empty_like(x)
    if t == 0 or topk_ids.shape[1] == 0:
        return out.zero_()
    route = build_routing(topk_weights, topk_ids, e, MAX_TOKENS)
    xq, xs = act_quant_fp8(x)
    p = topk_ids.numel()
    h = torch.empty(p, i, dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(p, i // 32, dtype=torch.float32, device=x.device)
    y = torch.empty(p, d, dtype=torch.bfloat16, device=x.device)
    n_tiles = route.tiles.shape[0]
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    common = (route.tiles, route.sorted_token, route.sorted_weight)
    # both as programmatic dependent launches: the weight stages stream in under the kernel before
    _kernel(1, d, i, cfg, dev).launch(
        (i // ROWS[1] * cfg.split1, n_tiles), THREADS,
        (_weight_map(w1), _weight_map(w3), *_token_maps(xq, xs), s1, s3, *common, h, hs,
         float(swiglu_limit), float(ACT_AMAX_FLOOR)),
        shared_bytes(1, d, i, cfg), programmatic=True,
    )  # fmt: skip
    w2_map = _weight_map(w2)
    _kernel(2, d, i, cfg, dev).launch(
        (d // ROWS[2] * cfg.split2, n_tiles), THREADS,
        (w2_map, w2_map, *_token_maps(h, hs), s2, s2, *common, y, None, 0.0, 0.0),
        shared_bytes(2, d, i, cfg), programmatic=True,
    )  # fmt: skip
    return combine(y, route, out)
