"""Triton MoE: router gate, token permutation, grouped FP8 x FP4 GEMMs, clamped SwiGLU, combine.

Layout. The (token, slot) pairs are sorted by expert (stable), and the sorted rows are cut into
tiles of BLOCK_M rows that never straddle two experts: a tile list [max_tiles] of (expert, first
row, end row) built on the device with torch ops. max_tiles is a host-side upper bound
(min(P, ceil(P / BLOCK_M) + E) for P pairs), so no step reads a count back to the host and the whole
path can be captured in a CUDA graph; tiles past the real count see expert -1 and exit. Prefill
uses 64-row tiles (the contiguous grouped layout; an expert holds ~128 rows at 8K tokens, so 64
wastes less of the last tile than 128 and lets 3-4 programs share an SM); decode uses 16-row tiles
so that a handful of tokens per expert wastes little (the padded layout).

Kernels. (0) x is quantised per 32 to FP8 and expanded back to bf16 (exactly x_fp8 * scale).
(1) W1 and W3 together: those bf16 rows gathered by token; FP4 weights (kept FP4 in memory)
expanded in registers to bf16 with their UE8M0 scales (exact: e2m1 x 2**e is a bf16 value);
bf16 tensor-core dots into fp32. The epilogue rounds gate/up to x.dtype, applies the clamped SwiGLU
and the routing weight, rounds to x.dtype, quantises per 32 to FP8 and writes it expanded to bf16:
the W2 input. (2) W2 on those sorted rows, rounded to x.dtype. (3) Combine: each token sums its
expert outputs in fp32 in ascending expert order. Every product is the reference's exact product;
only the fp32 summation order differs. Hopper has no FP4 (and Triton's FP8 path does not pipeline
at depth-32 promotion, see triton/linear.py), hence the exact bf16 expansion.

On CPU (the Triton interpreter, for tests) the kernels take F32_MATH paths: the same exact values
through fp32 dots, with bf16 and e4m3 rounding done by arithmetic, since the interpreter's bf16
dots and its fp32 -> bf16 / fp8 conversions are wrong (Triton 3.8).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .. import quant
from ..quant import ACT_AMAX_FLOOR
from ._common import (
    fp4_fragment_words_to_bf16_scaled,
    fp4_words_to_bf16_scaled,
    pow2_ceil_scale,
    quant_groups_fp8,
)
from .quant import act_fake_quant_bf16, swiglu_quant_tile

# ---------------------------------------------------------------------------------------------
# Gate
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gate_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    ow_ptr,
    oi_ptr,
    T,
    D,
    E,
    stride_bt,
    inv_temp,
    route_scale,
    HAS_BIAS: tl.constexpr,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    BF16_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < T
    rows = tl.where(tmask, offs_t, 0).to(tl.int64)
    cols = tl.arange(0, E_PAD)
    emask = cols < E
    ecl = tl.where(emask, cols, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        x = tl.load(x_ptr + rows[:, None] * D + offs_d[None, :], mask=dmask[None, :], other=0.0)
        w = tl.load(w_ptr + ecl[:, None] * D + offs_d[None, :], mask=dmask[None, :], other=0.0)
        if BF16_DOT:
            # bf16 x bf16 products are exact in fp32: tensor cores give the fp32 logits
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    z = acc * inv_temp
    # softplus as torch's (threshold 20); log1p(u) by Kahan's trick: log(w) * u / (w - 1), w = 1 + u
    u = tl.exp(tl.minimum(z, 20.0))
    w1p = 1.0 + u
    log1p = tl.where(w1p == 1.0, u, tl.log(w1p) * u / (w1p - 1.0))
    softplus = tl.where(z > 20.0, z, log1p)
    s = tl.sqrt(softplus)
    if HAS_BIAS:
        bias = tl.load(
            b_ptr + rows[:, None] * stride_bt + ecl[None, :], mask=emask[None, :], other=0.0
        )
        choose = s + bias
    else:
        choose = s
    choose = tl.where(emask[None, :], choose, float("-inf"))
    kcols = tl.arange(0, K_PAD)
    wsel = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    isel = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int64)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        idx = tl.argmax(choose, axis=1)
        hit = cols[None, :] == idx[:, None]
        val = tl.sum(tl.where(hit, s, 0.0), axis=1)
        total += val
        wsel = tl.where(kcols[None, :] == j, val[:, None], wsel)
        isel = tl.where(kcols[None, :] == j, idx[:, None].to(tl.int64), isel)
        choose = tl.where(hit, float("-inf"), choose)
    wsel = wsel / (total[:, None] + 1e-20) * route_scale
    omask = tmask[:, None] & (kcols[None, :] < TOPK)
    optr = rows[:, None] * TOPK + kcols[None, :]
    tl.store(ow_ptr + optr, wsel, mask=omask)
    tl.store(oi_ptr + optr, isel, mask=omask)


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
    """One fused kernel per 16 tokens: fp32 logits (bf16 tensor-core dot when x and weight are
    bf16, whose products are exact in fp32; else an fp32 FMA dot), sqrt-softplus, top-k on
    score + bias, normalised weights x route_scale. Tiles never depend on T: always
    batch-invariant."""
    t, d = x.shape
    e = weight.shape[0]
    w_out = torch.empty(t, topk, dtype=torch.float32, device=x.device)
    i_out = torch.empty(t, topk, dtype=torch.int64, device=x.device)
    if t == 0:
        return w_out, i_out
    x, weight = x.contiguous(), weight.contiguous()
    b = bias.float().contiguous() if bias is not None else w_out
    stride_bt = b.stride(0) if bias is not None and bias.dim() == 2 else 0
    e_pad = max(16, triton.next_power_of_2(e))
    block_t = 16
    _gate_kernel[(triton.cdiv(t, block_t),)](
        x,
        weight,
        b,
        w_out,
        i_out,
        t,
        d,
        e,
        stride_bt,
        1.0 / gate_temp,
        route_scale,
        HAS_BIAS=bias is not None,
        TOPK=topk,
        BF16_DOT=x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16,
        K_PAD=max(2, triton.next_power_of_2(topk)),
        BLOCK_T=block_t,
        E_PAD=e_pad,
        BLOCK_D=32 if e_pad <= 512 else 16,
        num_warps=8 if e_pad >= 512 else 4,
    )
    return w_out, i_out


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n1: int  # columns of I per program in the W1/W3 kernel
    block_n2: int  # columns of D per program in the W2 kernel
    warps1: int
    warps2: int
    stages: int
    swap_ab: bool = False
    block_k: int = 32  # K per step (falls back to 32 where D or I is not a multiple)
    scale_words: bool = False  # UE8M0 scales read as int32 words (4 groups; needs block_k 128)
    cols_fast: bool = False  # grid order: a tile's column blocks run together (`_program_tile`)
    block_k2: int = 0  # K step of the W2 kernel (0: block_k)
    stages2: int = 0  # pipeline stages of the W2 kernel (0: stages)
    prefetch_scales: bool = False  # load the next K step's scale bytes one step ahead
    cols_fast2: bool | None = None  # grid order of the W2 kernel (None: cols_fast)
    # the weights are in `quant.fp4_fragment_order` (K steps of 64 or 128; the same sums)
    fragment_weights: bool = False

    def __post_init__(self) -> None:
        steps = (self.block_k, self.block_k2 or self.block_k)
        if any(k % 32 or k < 32 for k in steps):
            raise ValueError(
                "MoeConfig: K steps must be positive multiples of 32, got "
                f"block_k={self.block_k}, block_k2={self.block_k2}"
            )
        if self.fragment_weights and not set(steps) <= {64, 128}:
            raise ValueError(
                "MoeConfig.fragment_weights needs K steps of 64 or 128, got "
                f"block_k={self.block_k}, block_k2={self.block_k2}"
            )


DECODE = MoeConfig(16, 64, 64, 4, 4, 4, swap_ab=False, block_k=128)
"""Few rows per expert: 16-row tiles on mma.sync, FP4 expanded from int32 words by packed PTX."""
DECODE_WGMMA = MoeConfig(16, 64, 64, 4, 4, 4, swap_ab=True, block_k=128, scale_words=True)
"""The same with A and B swapped so wgmma runs it: what batch-invariant mode uses for decode (its
rows are bitwise those of PREFILL's wgmma tiles: the FP4 expansions give identical bf16 values).
Its scales are read as int32 words (faster on this wgmma path, slower on DECODE's mma.sync path,
where the converted tile then goes through shared memory)."""
PREFILL = MoeConfig(64, 64, 128, 4, 4, 3, block_k=64, cols_fast=True, prefetch_scales=True)
"""The contiguous grouped layout for prefill: 64-row tiles on wgmma, one warpgroup per program
(W1/W3: 64 + 64 columns, W2: 128), scale bytes loaded a K step ahead, the column-fast grid."""
PREFILL_FRAGMENT = replace(PREFILL, block_k=128, stages=2, fragment_weights=True)
"""PREFILL on weights in `quant.fp4_fragment_order`: 128-wide K steps (a 64-wide step gathers half
of each 64-byte step), 2 stages; the same bits."""


@dataclass
class Routing:
    """Pairs sorted by expert and the tile list over them (all device tensors)."""

    sorted_token: torch.Tensor  # [P] int32: token of each sorted row
    sorted_weight: torch.Tensor  # [P] fp32: routing weight of each sorted row
    tiles: torch.Tensor  # [max_tiles, 3] int32: (expert or -1, first row, end row)
    combine_pos: torch.Tensor  # [T, k] int32: sorted rows of each token, ascending; P = none


FUSED_ROUTING_MAX_PAIRS = 2048
"""Decode-sized routings (T * k pairs up to this, E + 2 up to 1024) are built by one program
(`_routing_kernel`); larger ones by torch ops (their cost is small next to prefill's GEMMs)."""


@triton.jit
def _routing_kernel(
    ids_ptr,
    tw_ptr,
    tok_ptr,
    sw_ptr,
    tiles_ptr,
    pos_ptr,
    inv_ptr,
    P,
    E,
    max_tiles,
    max_tiles_per_expert,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    P_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    T_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """The whole `Routing` of up to P_PAD pairs in one program: the same tensors as the torch path
    of `build_routing` (a stable sort by expert, tiles of BLOCK_M rows, each token's sorted rows
    ascending), with no host sync and ~1 launch instead of ~30.

    Stable order: sorting key * P_PAD + pair index (unique keys) is a stable sort by key. Negative
    ids key E (after every real expert), padding E + 1."""
    p = tl.arange(0, P_PAD)
    pmask = p < P
    ids = tl.load(ids_ptr + p, mask=pmask, other=0).to(tl.int32)
    key = tl.where(pmask, tl.where(ids >= 0, ids, E), E + 1)
    ordered = tl.sort(key * P_PAD + p)
    order = ordered % P_PAD
    tl.store(tok_ptr + p, (order // TOPK).to(tl.int32), mask=pmask)
    tl.store(sw_ptr + p, tl.load(tw_ptr + order, mask=pmask, other=0.0), mask=pmask)
    tl.store(inv_ptr + order, p, mask=pmask)  # inv[order[i]] = i, read back after the barrier
    # per-expert counts, first sorted row, tiles
    counts = tl.histogram(key, E_PAD)
    e = tl.arange(0, E_PAD)
    counts = tl.where(e < E, counts, 0)
    first = tl.cumsum(counts, 0) - counts
    ntiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile0 = tl.cumsum(ntiles, 0) - ntiles
    total = tl.sum(ntiles, 0)
    for j in range(0, max_tiles_per_expert):
        has = j < ntiles
        tid = tile0 + j
        tl.store(tiles_ptr + tid * 3, e, mask=has)
        tl.store(tiles_ptr + tid * 3 + 1, first + j * BLOCK_M, mask=has)
        tl.store(tiles_ptr + tid * 3 + 2, first + counts, mask=has)
    for t0 in range(0, max_tiles, E_PAD):  # unused tiles: expert -1
        tid = t0 + e
        unused = (tid >= total) & (tid < max_tiles)
        tl.store(tiles_ptr + tid * 3, tl.full((E_PAD,), -1, tl.int32), mask=unused)
        tl.store(tiles_ptr + tid * 3 + 1, tl.zeros((E_PAD,), tl.int32), mask=unused)
        tl.store(tiles_ptr + tid * 3 + 2, tl.zeros((E_PAD,), tl.int32), mask=unused)
    tl.debug_barrier()
    # each token's sorted rows, ascending (= ascending expert); P for a negative id
    tk = tl.arange(0, T_PAD)[:, None] * TOPK + tl.arange(0, K_PAD)[None, :]
    kmask = (tl.arange(0, K_PAD) < TOPK)[None, :] & (tk < P)
    row_ids = tl.load(ids_ptr + tk, mask=kmask, other=0)
    inv = tl.load(inv_ptr + tk, mask=kmask, other=0)
    inv = tl.where(row_ids >= 0, inv, P)
    inv = tl.where(kmask, inv, 2147483647)  # padding sorts last, never stored
    tl.store(pos_ptr + tk, tl.sort(inv, 1), mask=kmask)


def _routing_fused(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: int, block_m: int, max_tiles: int
) -> Routing:
    t, k = topk_ids.shape
    p = t * k
    dev = topk_ids.device
    tok = torch.empty(p, dtype=torch.int32, device=dev)
    sw = torch.empty(p, dtype=torch.float32, device=dev)
    tiles = torch.empty(max_tiles, 3, dtype=torch.int32, device=dev)
    pos = torch.empty(t, k, dtype=torch.int32, device=dev)
    inv = torch.empty(p, dtype=torch.int32, device=dev)
    _routing_kernel[(1,)](
        topk_ids.contiguous(),
        topk_weights.float().contiguous(),
        tok,
        sw,
        tiles,
        pos,
        inv,
        p,
        experts,
        max_tiles,
        triton.cdiv(t, block_m),  # an expert holds at most one pair per token
        TOPK=k,
        BLOCK_M=block_m,
        P_PAD=triton.next_power_of_2(p),
        E_PAD=triton.next_power_of_2(experts + 2),
        T_PAD=triton.next_power_of_2(t),
        K_PAD=max(2, triton.next_power_of_2(k)),
        num_warps=8,
    )
    return Routing(sorted_token=tok, sorted_weight=sw, tiles=tiles, combine_pos=pos)


def build_routing(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: int,
    block_m: int,
    *,
    fused: bool | None = None,
) -> Routing:
    """Sort the (token, slot) pairs by expert and cut them into tiles (see the module docstring).

    fused: one-program kernel (default for P <= FUSED_ROUTING_MAX_PAIRS) or torch ops; the same
    tensors either way. Requires that a token's ids be distinct (top-k is)."""
    t, k = topk_ids.shape
    max_tiles = max(1, min(t * k, triton.cdiv(t * k, block_m) + experts))
    if fused is None:
        fused = 0 < t * k <= FUSED_ROUTING_MAX_PAIRS and experts + 2 <= 1024
    if fused:
        return _routing_fused(topk_weights, topk_ids, experts, block_m, max_tiles)
    p = t * k
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, experts)
    order = torch.argsort(key, stable=True)
    # scatter-add, not bincount: bincount reads its max back to the host (no graph capture)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=dev)
    counts.index_add_(0, key, torch.ones_like(key))
    counts = counts[:experts]
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
    tiles_per = (counts + block_m - 1) // block_m
    tile_cum = torch.cumsum(tiles_per, 0)
    tid = torch.arange(max_tiles, device=dev)
    e = torch.searchsorted(tile_cum, tid, right=True)
    valid = e < experts
    ec = e.clamp(max=experts - 1)
    first = offsets[ec] + (tid - (tile_cum[ec] - tiles_per[ec])) * block_m
    tiles = torch.stack(
        (
            torch.where(valid, ec, -1),
            torch.where(valid, first, 0),
            torch.where(valid, offsets[ec + 1], 0),
        ),
        dim=1,
    ).to(torch.int32)
    inv = torch.empty(p, dtype=torch.int64, device=dev)
    inv[order] = torch.arange(p, device=dev)
    pos = torch.where(flat >= 0, inv, p).view(t, k).sort(dim=1).values
    return Routing(
        sorted_token=(order // k).to(torch.int32),
        sorted_weight=topk_weights.reshape(-1).float()[order].contiguous(),
        tiles=tiles.contiguous(),
        combine_pos=pos.to(torch.int32).contiguous(),
    )


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs
# ---------------------------------------------------------------------------------------------


@triton.jit
def _scale_bytes(s_ptrs, offs_g, WORDS: tl.constexpr, mask=None):
    """The UE8M0 scale bytes [rows, KG] of one K step: from per-row pointers to one int32 word of
    4 bytes, lowest first (WORDS, KG == 4), or from [rows, KG] byte pointers. The word is a 4-byte
    load, which the pipeliner turns into cp.async; a 1- or 2-byte load stays synchronous and puts
    a memory latency into every K step (unless loaded a step ahead: PREFETCH in the kernels)."""
    if mask is None:  # noqa: SIM108 (a Triton constexpr branch)
        v = tl.load(s_ptrs)
    else:
        v = tl.load(s_ptrs, mask=mask, other=0)
    if WORDS:
        v = (v[:, None] >> (8 * offs_g)[None, :]) & 0xFF
    return v


@triton.jit
def _program_tile(n_cols, COLS_FAST: tl.constexpr):
    """(tile, column block) of this program. COLS_FAST: a 1-D grid in which consecutive programs
    are the column blocks of one tile, so the programs resident at one time share a few tiles'
    gathered rows and a few experts' weights. Otherwise a 2-D grid (tile, column block) with the
    tile fastest: resident programs hold hundreds of tiles of one column block. Which is faster
    depends on the tile, so it is a choice of the config."""
    if COLS_FAST:
        pid = tl.program_id(0)
        tile = pid // n_cols
        col = pid % n_cols
    else:
        tile = tl.program_id(0)
        col = tl.program_id(1)
    return tile, col


@triton.jit
def _tile_rows(tiles_ptr, tile, BLOCK_M: tl.constexpr):
    """Tile `tile` of sorted rows (tiles: [n, 3] int32 (expert, first row, end row)):
    (first row, rows [BLOCK_M], mask of the rows before the end)."""
    row0 = tl.load(tiles_ptr + tile * 3 + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    return row0, rows, rows < tl.load(tiles_ptr + tile * 3 + 2)


@triton.jit
def _expand(
    packed,
    scale_u8,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_MATH: tl.constexpr,
    FRAGMENT: tl.constexpr = False,
):
    """FP4 words [ROWS, BLOCK_K / 8] int32 with UE8M0 scales -> [ROWS, BLOCK_K] bf16 values:
    `fp4_words_to_bf16_scaled` (FRAGMENT: words in `quant.fp4_fragment_order`,
    `fp4_fragment_words_to_bf16_scaled`). F32_MATH (the Triton interpreter on CPU, whose bf16
    arithmetic is wrong and which has no inline PTX): the same exact values through fp32."""
    if F32_MATH:
        w = packed.to(tl.uint32, bitcast=True)
        sh = tl.arange(0, 8) * 4
        nib = (w[:, :, None] >> sh[None, None, :]) & 0xF  # 8 nibbles a word, lowest first
        if FRAGMENT:  # words (t, c), nibble 2m + b: value 32c + 8m + 2t + b
            CG: tl.constexpr = BLOCK_K // 32
            nib = tl.permute(tl.reshape(nib, (ROWS, 4, CG, 4, 2)), (0, 2, 3, 1, 4))
        nib = tl.reshape(nib, (ROWS, BLOCK_K)).to(tl.int32)
        bits = (((nib & 7) << 9) | ((nib & 8) << 12)).to(tl.int16)
        v = bits.to(tl.float16, bitcast=True).to(tl.float32)  # e2m1 value * 2**-14
        s = ((scale_u8.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
        v3 = tl.reshape(v, (ROWS, BLOCK_K // 32, 32)) * s[:, :, None]
        return tl.reshape(v3, (ROWS, BLOCK_K)).to(tl.bfloat16)
    elif FRAGMENT:
        return fp4_fragment_words_to_bf16_scaled(packed, scale_u8, ROWS, BLOCK_K // 8)
    else:
        return fp4_words_to_bf16_scaled(packed, scale_u8, ROWS, BLOCK_K // 8)


@triton.jit
def _weight_step(
    w_ptrs,
    s_ptrs,
    s_ahead,
    offs_g,
    more,
    SPEC: tl.constexpr,
):
    """One K step of one FP4 weight matrix, as all three GEMMs (W1, W3, W2) run it: load the packed
    tile [ROWS, BLOCK_K / 8] int32, then its UE8M0 scales (PREFETCH: take `s_ahead`, loaded during
    the previous step, and load the next step's now, if `more`), then expand to bf16
    [ROWS, BLOCK_K]. The order (weights, then scales, then expansion) is the one the decode SASS
    was measured in. Returns (expanded tile, the scales to pass as `s_ahead` next step; without
    PREFETCH `s_ahead` unchanged). SPEC: the kernel's constants (ROWS, BLOCK_K, S_WORDS,
    PREFETCH, F32_MATH, FRAGMENT) as one tuple, built once per kernel (Triton 3.6 compiles
    indexing into a constexpr tuple, not `*SPEC` unpacking)."""
    ROWS: tl.constexpr = SPEC[0]
    BLOCK_K: tl.constexpr = SPEC[1]
    S_WORDS: tl.constexpr = SPEC[2]
    PREFETCH: tl.constexpr = SPEC[3]
    F32_MATH: tl.constexpr = SPEC[4]
    FRAGMENT: tl.constexpr = SPEC[5]
    wq = tl.load(w_ptrs)
    if PREFETCH:
        cur = s_ahead
        S_STEP: tl.constexpr = 1 if S_WORDS else BLOCK_K // 32
        nxt = _scale_bytes(s_ptrs + S_STEP, offs_g, S_WORDS, more)
    else:
        cur = _scale_bytes(s_ptrs, offs_g, S_WORDS)
        nxt = s_ahead
    return _expand(wq, cur, ROWS, BLOCK_K, F32_MATH, FRAGMENT), nxt


@triton.jit
def _dot(a, b, acc, F32_MATH: tl.constexpr):
    """acc + a @ b for bf16 tiles (exact products, fp32 sums); F32_MATH: the same through an fp32
    IEEE dot (the interpreter's bf16 dot is wrong)."""
    if F32_MATH:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tile_operands(
    a_ptr,
    a_rows,
    a_stride,
    expert,
    col,
    n,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    SPEC: tl.constexpr,
):
    """The first K step's operands of one program, as both grouped GEMMs address them: the bf16
    activations' pointers [BLOCK_M, BLOCK_K] (rows `a_rows` [BLOCK_M] int64 of a [*, a_stride]
    matrix), and column block `col` of expert `expert`'s FP4 weights [E, n, K / PACK] (PACK
    values per int8 or int32 element) with their UE8M0 scales. Returns (a pointers, columns
    offs_n [BLOCK_N] (those >= n read column 0: the stores mask them), offsets of the packed
    weights [BLOCK_N, BLOCK_K / PACK], offsets of the scales ([BLOCK_N] int32 words of 4 groups
    with S_WORDS, else [BLOCK_N, BLOCK_K / 32] bytes), the group index offs_g [BLOCK_K / 32],
    the weight and the scale offsets' advance per K step). The order of the lines is the one the
    SASS was measured in (another order reschedules W2's decode prologue). SPEC: the kernel's
    constants, as `_weight_step` takes them."""
    BLOCK_N: tl.constexpr = SPEC[0]
    BLOCK_K: tl.constexpr = SPEC[1]
    S_WORDS: tl.constexpr = SPEC[2]
    FRAGMENT: tl.constexpr = SPEC[5]
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    ncl = tl.where(offs_n < n, offs_n, 0).to(tl.int64)
    ex = expert.to(tl.int64)
    KG: tl.constexpr = BLOCK_K // 32
    PACK: tl.constexpr = 8  # FP4 values per int32 word
    offs_k = tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_K // PACK)
    if FRAGMENT and BLOCK_K == 64:  # groups 0, 1 of a 64-byte step: words (t, c) at 4t + c
        offs_p = 4 * (offs_p // 2) + offs_p % 2
    offs_g = tl.arange(0, KG)
    a_ptrs = a_ptr + a_rows[:, None] * a_stride + offs_k[None, :]
    w_off = ex * stride_we + ncl[:, None] * stride_wn + offs_p[None, :]
    if S_WORDS:  # one int32 word (the step's 4 scale bytes) per weight row
        s_off = ex * stride_se + ncl * stride_sn
    else:
        s_off = ex * stride_se + ncl[:, None] * stride_sn + offs_g[None, :]
    return a_ptrs, offs_n, w_off, s_off, offs_g, BLOCK_K // PACK, 1 if S_WORDS else KG


@triton.jit
def _w_advance(k0, W_STEP: tl.constexpr, SPEC: tl.constexpr):
    """How far the weight pointers move after the K step at k0: W_STEP elements, except for
    fragment-order weights read 64 values at a time (FP4 words), whose second half-step sits 2
    words into the same 64-byte step and whose next step 14 words after that."""
    BLOCK_K: tl.constexpr = SPEC[1]
    FRAGMENT: tl.constexpr = SPEC[5]
    if FRAGMENT and BLOCK_K == 64:
        return tl.where((k0 // 64) % 2 == 0, 2, 14)
    else:
        return W_STEP


@triton.jit
def _first_scales(s_ptrs, offs_g, S_WORDS: tl.constexpr, PREFETCH: tl.constexpr):
    """PREFETCH: the first K step's scales (each step then loads the next step's); otherwise an
    unused placeholder that `_weight_step` passes through."""
    if PREFETCH:  # noqa: SIM108 (a Triton constexpr branch)
        sc = _scale_bytes(s_ptrs, offs_g, S_WORDS)
    else:
        sc = 0
    return sc


@triton.jit
def _acc_tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """The fp32 accumulator: [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with SWAP_AB (the weight
    rows fill the MMA's M: few tokens per expert, decode)."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _tile_dot(a16, b16, acc, SWAP_AB: tl.constexpr, F32_MATH: tl.constexpr):
    """acc + a16 [BLOCK_M, BLOCK_K] @ b16 [BLOCK_N, BLOCK_K]^T in `_acc_tile`'s layout."""
    if SWAP_AB:
        acc = _dot(b16, tl.trans(a16), acc, F32_MATH)
    else:
        acc = _dot(a16, tl.trans(b16), acc, F32_MATH)
    return acc


@triton.jit
def _round_to(v, DTYPE: tl.constexpr, F32_MATH: tl.constexpr):
    """fp32 v rounded to DTYPE (to nearest, ties to even), returned as fp32. F32_MATH rounds to
    bf16 on the float's bits: the interpreter's fp32 -> bf16 conversion does not round to nearest
    (Triton 3.8 on CPU)."""
    if F32_MATH and tl.bfloat16 == DTYPE:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)
    else:
        return v.to(DTYPE).to(tl.float32)


@triton.jit
def _cast(v, DTYPE: tl.constexpr, F32_MATH: tl.constexpr):
    """fp32 v -> DTYPE, rounded to nearest (F32_MATH: through `_round_to`)."""
    if F32_MATH:
        return _round_to(v, DTYPE, True).to(DTYPE)
    else:
        return v.to(DTYPE)


@triton.jit
def _swiglu(
    g, u, w, limit, HAS_LIMIT: tl.constexpr, OUT_DTYPE: tl.constexpr, F32_MATH: tl.constexpr
):
    """`swiglu_quant_tile` (V4.1's clamped SwiGLU x routing weight, rounded to OUT_DTYPE, as
    fp32); F32_MATH: the same formula with the rounding of `_round_to`."""
    if F32_MATH:
        if HAS_LIMIT:
            u = tl.clamp(u, -limit, limit)
            g = tl.minimum(g, limit)
        return _round_to(w * (g / (1.0 + tl.exp(-g)) * u), OUT_DTYPE, True)
    else:
        return swiglu_quant_tile(g, u, w, limit, HAS_LIMIT, OUT_DTYPE)


@triton.jit
def _round_e4m3_f32(v):
    """fp32 v (|v| <= 448) rounded to the nearest e4m3 value (ties to even), as fp32: the
    interpreter's fp8 conversion rounds some values wrongly (Triton 3.8 on CPU), so F32_MATH does
    it by arithmetic: the e4m3 step at v's binade (2**-9 below 2**-6), then a round-to-integer by
    adding and subtracting 1.5 * 2**23."""
    a = tl.abs(v)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    step = ((e - 3) << 23).to(tl.float32, bitcast=True)
    r = ((a / step + 12582912.0) - 12582912.0) * step
    return tl.where(v < 0, -r, r)


@triton.jit
def _quant_dequant_groups(
    h, ROWS: tl.constexpr, WIDTH: tl.constexpr, FLOOR: tl.constexpr, F32_MATH: tl.constexpr
):
    """h [ROWS, WIDTH] fp32 -> bf16 h_fp8 * scale (per-32 FP8 quantisation, expanded exactly)."""
    if F32_MATH:
        g3 = tl.reshape(h, (ROWS, WIDTH // 32, 32))
        amax = tl.maximum(tl.max(tl.abs(g3), axis=2), FLOOR)
        sc, inv = pow2_ceil_scale(amax, 1.0 / 448.0)
        q = _round_e4m3_f32(tl.clamp(g3 * inv[:, :, None], -448.0, 448.0))
        hd = q * sc[:, :, None]
    else:
        q, sc = quant_groups_fp8(h, ROWS, WIDTH, FLOOR)
        hd = tl.reshape(q.to(tl.float32), (ROWS, WIDTH // 32, 32)) * sc[:, :, None]
    return tl.reshape(hd, (ROWS, WIDTH)).to(tl.bfloat16)


@triton.jit
def _w13_kernel(
    xa_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    tok_ptr,
    rw_ptr,
    tiles_ptr,
    h_ptr,
    D,
    I,
    limit,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    OUT_DTYPE: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    S_WORDS: tl.constexpr,
    COLS_FAST: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    F32_MATH: tl.constexpr = False,
    FRAGMENT: tl.constexpr = False,
):
    """Rows of one expert's tile: gate/up = x_hat W1^T, x_hat W3^T (x_hat: bf16-expanded FP8 x,
    gathered by token), then h = swiglu(gate, up) * weight, quantised per 32 to FP8 and written
    expanded to bf16 (exactly h_fp8 * scale): the W2 kernel's A operand."""
    tile, col = _program_tile(tl.cdiv(I, BLOCK_N), COLS_FAST)
    expert = tl.load(tiles_ptr + tile * 3)
    if expert < 0:
        return
    _, rows, rmask = _tile_rows(tiles_ptr, tile, BLOCK_M)
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    SPEC: tl.constexpr = (BLOCK_N, BLOCK_K, S_WORDS, PREFETCH, F32_MATH, FRAGMENT)
    a_ptrs, offs_n, w_off, s_off, offs_g, W_STEP, S_STEP = _tile_operands(
        xa_ptr, tok, D, expert, col, I, stride_we, stride_wn, stride_se, stride_sn, SPEC
    )
    w1_ptrs = w1_ptr + w_off
    w3_ptrs = w3_ptr + w_off
    s1_ptrs = s1_ptr + s_off
    s3_ptrs = s3_ptr + s_off
    sc1 = _first_scales(s1_ptrs, offs_g, S_WORDS, PREFETCH)
    sc3 = _first_scales(s3_ptrs, offs_g, S_WORDS, PREFETCH)
    acc_g = _acc_tile(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_u = _acc_tile(BLOCK_M, BLOCK_N, SWAP_AB)
    # D is a multiple of BLOCK_K (checked on the host): no masks in the loop
    for k0 in range(0, D, BLOCK_K):
        a16 = tl.load(a_ptrs)
        # W1's whole step before W3's: the order the decode path's SASS was measured in (a
        # reordering changes its schedule)
        more = k0 + BLOCK_K < D
        b1, sc1 = _weight_step(w1_ptrs, s1_ptrs, sc1, offs_g, more, SPEC)
        b3, sc3 = _weight_step(w3_ptrs, s3_ptrs, sc3, offs_g, more, SPEC)
        acc_g = _tile_dot(a16, b1, acc_g, SWAP_AB, F32_MATH)
        acc_u = _tile_dot(a16, b3, acc_u, SWAP_AB, F32_MATH)
        a_ptrs += BLOCK_K
        w_step = _w_advance(k0, W_STEP, SPEC)
        w1_ptrs += w_step
        w3_ptrs += w_step
        s1_ptrs += S_STEP
        s3_ptrs += S_STEP
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    g = _round_to(acc_g, OUT_DTYPE, F32_MATH)
    u = _round_to(acc_u, OUT_DTYPE, F32_MATH)
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    h = _swiglu(g, u, rw[:, None], limit, HAS_LIMIT, OUT_DTYPE, F32_MATH)
    hd = _quant_dequant_groups(h, BLOCK_M, BLOCK_N, FLOOR, F32_MATH)
    r64 = rows.to(tl.int64)
    omask = rmask[:, None] & (offs_n < I)[None, :]
    tl.store(h_ptr + r64[:, None] * I + offs_n[None, :], hd, mask=omask)


@triton.jit
def _w2_kernel(
    h_ptr,
    w2_ptr,
    s2_ptr,
    tiles_ptr,
    y_ptr,
    D,
    I,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    S_WORDS: tl.constexpr,
    COLS_FAST: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    F32_MATH: tl.constexpr = False,
    FRAGMENT: tl.constexpr = False,
):
    """y = h_hat W2^T for one expert's tile of sorted rows, rounded to y's dtype."""
    tile, col = _program_tile(tl.cdiv(D, BLOCK_N), COLS_FAST)
    expert = tl.load(tiles_ptr + tile * 3)
    if expert < 0:
        return
    row0, rows, rmask = _tile_rows(tiles_ptr, tile, BLOCK_M)
    r64 = tl.where(rmask, rows, row0).to(tl.int64)
    SPEC: tl.constexpr = (BLOCK_N, BLOCK_K, S_WORDS, PREFETCH, F32_MATH, FRAGMENT)
    a_ptrs, offs_n, w_off, s_off, offs_g, W_STEP, S_STEP = _tile_operands(
        h_ptr, r64, I, expert, col, D, stride_we, stride_wn, stride_se, stride_sn, SPEC
    )
    w_ptrs = w2_ptr + w_off
    s_ptrs = s2_ptr + s_off
    sc = _first_scales(s_ptrs, offs_g, S_WORDS, PREFETCH)
    acc = _acc_tile(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, I, BLOCK_K):
        a16 = tl.load(a_ptrs)
        b16, sc = _weight_step(w_ptrs, s_ptrs, sc, offs_g, k0 + BLOCK_K < I, SPEC)
        acc = _tile_dot(a16, b16, acc, SWAP_AB, F32_MATH)
        a_ptrs += BLOCK_K
        w_ptrs += _w_advance(k0, W_STEP, SPEC)
        s_ptrs += S_STEP
    if SWAP_AB:
        acc = tl.trans(acc)
    omask = rmask[:, None] & (offs_n < D)[None, :]
    y = _cast(acc, y_ptr.dtype.element_ty, F32_MATH)
    tl.store(y_ptr + r64[:, None] * D + offs_n[None, :], y, mask=omask)


@triton.jit
def _combine_kernel(
    y_ptr, pos_ptr, out_ptr, D, P, TOPK: tl.constexpr, BLOCK: tl.constexpr, F32_MATH: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = tl.load(pos_ptr + t * TOPK + j)
        y = tl.load(y_ptr + p.to(tl.int64) * D + cols, mask=cmask & (p < P), other=0.0)
        acc += y.to(tl.float32)
    out = _cast(acc, out_ptr.dtype.element_ty, F32_MATH)
    tl.store(out_ptr + t * D + cols, out, mask=cmask)


def combine(y: torch.Tensor, route: Routing, out: torch.Tensor) -> torch.Tensor:
    """out[t] = sum of y's rows for token t (`route.combine_pos`, ascending), summed in fp32 and
    rounded to out.dtype. y [P, D] (one row per routed pair), out [T, D]; returns out."""
    t, k = route.combine_pos.shape
    p, d = y.shape
    block = 1024
    _combine_kernel[(t, triton.cdiv(d, block))](
        y, route.combine_pos, out, d, p, TOPK=k, BLOCK=block, F32_MATH=not y.is_cuda
    )
    return out


def _word_aligned(*scales: torch.Tensor) -> bool:
    """Whether the byte tensors can be read as int32 words (storage offset on a 4-byte boundary;
    rows of whole words follow from a 128-wide K step)."""
    return all(s.storage_offset() % 4 == 0 for s in scales)


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


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
    config: MoeConfig,
    fragment_order: bool = False,
) -> torch.Tensor:
    """Routed FP4 experts on the GPU with `config`'s tiles (`ops.moe.triton_config` picks them);
    same contract and numerics as `ref.moe.moe_experts` (fragment_order: w1, w3, w2 in
    `quant.fp4_fragment_order`, the same sums; the config must then have fragment_weights)."""
    t, d = x.shape
    k = topk_ids.shape[1]
    e, i = w1.shape[0], w1.shape[1]
    if config.fragment_weights != fragment_order:
        raise ValueError(
            f"triton moe_experts: config.fragment_weights={config.fragment_weights} but "
            f"fragment_order={fragment_order}"
        )
    out = torch.empty_like(x)
    if t == 0 or k == 0:
        return out.zero_()
    cfg = config
    for name, s in (("s1", s1), ("s3", s3), ("s2", s2)):
        if s.dtype != torch.float8_e8m0fnu:  # ops.moe routes other scale dtypes to ref
            raise NotImplementedError(f"triton moe_experts: {name} must be float8_e8m0fnu")
    if cfg.fragment_weights and (d % 128 or i % 128):
        raise ValueError(
            f"triton moe_experts: fragment-order weights need D and I multiples of 128, got "
            f"D={d}, I={i}"
        )
    route = build_routing(topk_weights, topk_ids, e, cfg.block_m)
    if x.is_cuda:
        xa = act_fake_quant_bf16(x)
    else:  # the Triton interpreter: its fp8 conversion is wrong (see `_round_e4m3_f32`)
        xa = quant.act_dequant_fp8(*quant.act_quant_fp8(x), torch.bfloat16)
    p = t * k
    h = torch.empty(p, i, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(p, d, dtype=x.dtype, device=x.device)
    w1, w3, w2 = w1.contiguous(), w3.contiguous(), w2.contiguous()
    # the packed bytes read as int32 words (8 values); strides in words
    w1, w3, w2 = w1.view(torch.int32), w3.view(torch.int32), w2.view(torch.int32)
    s1u, s3u, s2u = (s.contiguous().view(torch.uint8) for s in (s1, s3, s2))
    bk1 = cfg.block_k if d % cfg.block_k == 0 else 32
    k2 = cfg.block_k2 or cfg.block_k
    bk2 = k2 if i % k2 == 0 else 32
    # scales as int32 words: one word is exactly one 128-wide K step's 4 groups
    words1 = cfg.scale_words and bk1 == 128 and _word_aligned(s1u, s3u)
    words2 = cfg.scale_words and bk2 == 128 and _word_aligned(s2u)
    if words1:
        s1u, s3u = s1u.view(torch.int32), s3u.view(torch.int32)
    if words2:
        s2u = s2u.view(torch.int32)
    n_tiles = route.tiles.shape[0]
    f32_math = not x.is_cuda  # the Triton interpreter (CPU tensors): see `_dot`
    cols1, cols2 = triton.cdiv(i, cfg.block_n1), triton.cdiv(d, cfg.block_n2)
    grid1 = (n_tiles * cols1,) if cfg.cols_fast else (n_tiles, cols1)
    cols_fast2 = cfg.cols_fast if cfg.cols_fast2 is None else cfg.cols_fast2
    grid2 = (n_tiles * cols2,) if cols_fast2 else (n_tiles, cols2)
    _w13_kernel[grid1](
        xa,
        w1,
        s1u,
        w3,
        s3u,
        route.sorted_token,
        route.sorted_weight,
        route.tiles,
        h,
        d,
        i,
        float(swiglu_limit),
        w1.stride(0),
        w1.stride(1),
        s1u.stride(0),
        s1u.stride(1),
        OUT_DTYPE=_TL_DTYPE[x.dtype],
        HAS_LIMIT=swiglu_limit > 0,
        FLOOR=ACT_AMAX_FLOOR,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n1,
        BLOCK_K=bk1,
        SWAP_AB=cfg.swap_ab,
        S_WORDS=words1,
        COLS_FAST=cfg.cols_fast,
        PREFETCH=cfg.prefetch_scales,
        F32_MATH=f32_math,
        FRAGMENT=cfg.fragment_weights,
        num_warps=cfg.warps1,
        num_stages=cfg.stages,
    )
    _w2_kernel[grid2](
        h,
        w2,
        s2u,
        route.tiles,
        y,
        d,
        i,
        w2.stride(0),
        w2.stride(1),
        s2u.stride(0),
        s2u.stride(1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n2,
        BLOCK_K=bk2,
        SWAP_AB=cfg.swap_ab,
        S_WORDS=words2,
        COLS_FAST=cols_fast2,
        PREFETCH=cfg.prefetch_scales,
        F32_MATH=f32_math,
        FRAGMENT=cfg.fragment_weights,
        num_warps=cfg.warps2,
        num_stages=cfg.stages2 or cfg.stages,
    )
    return combine(y, route, out)
