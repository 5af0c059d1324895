"""TileLang grouped decode GEMM for V4.1's FP4 experts on Hopper (sm_90a): a first version.

out[r, n] = sum_k (x[t, k] * sx[t, k // 32]) * (e2m1(w[e, n, k]) * 2**(u[e, n, k // 32] - 127)),
t = tok(r), e = e(r),

for the routed rows r of a `triton.moe.Routing` (pairs sorted by expert, cut into tiles of at most
16 rows of one expert), fp32 accumulation, with
- x [T, K] FP8 e4m3 and sx [T, K/32] fp32 powers of two (`quant.act_quant_fp8`),
- w [E, N, K/2] FP4 e2m1 packed two per byte, element 2j in the low nibble (`quant.pack_fp4`),
- u [E, N, K/32] UE8M0 bytes, one per weight row per 32 along K (`quant.quantize_fp4_experts`).

Structure (the dense decode kernel's, `decode_gemm.py`, with FP4 weights): one CTA per (routing
tile, 64 weight rows, K chunk). TileLang warp-specialises the K loop: a producer warpgroup TMAs a
ring of 128-deep K tiles: the packed weight rows of the tile's expert (64 rows x 64 B, read as
int32 words), the tile's activation rows (gathered into routing order by the host beforehand:
Hopper's TMA cannot gather rows) and their scales. The consumer warpgroup expands the packed
nibbles into FP8 e4m3 in shared memory, then runs one ``wgmma.m64n16k32`` per 32-slice with the
weights as A and the 16 tile rows as B, and promotes each partial on CUDA cores:
``acc[n, r] += part[n, r] * (2**(u[n, kb] - 121) * sx[r, kb])`` (one FMUL + one FFMA per value).

Why e4m3 and how: every e2m1 value is exact in e4m3, and the bit placement is one shift per
value: an e2m1 magnitude (e1 e0 m) put at e4m3's bits 4..2 (exponent field 00e1e0, mantissa m00)
is the e2m1 value times 2**-6 (e = 0 lands on e4m3's subnormals: 0 and 0.5 x 2**-6 exactly), the
sign goes to bit 7. The 2**6 is folded into the weight scale of the promotion (2**(u - 127 + 6)),
so the products are the reference's exact products; only the fp32 summation order differs.

Why expanded into shared memory and wgmma from shared (not A from registers): TileLang 0.1.15's
layout inference gives a register A operand its own fragment layout, which the expansion would
have to produce from packed words that the TMA lays out by rows; the shared round trip costs one
LDS of packed bytes and one STS of e4m3 bytes per value pair, keeps the wgmma on the layout the
dense kernel already runs (128-B rows, 128-B swizzle), and the single e4m3 tile per CTA is reused
every K step (the previous step's wgmmas are waited before it is rewritten).

K is split into `split` chunks from (N, K) only (`moe_decode_split`), the chunks' fp32 partials
summed in ascending order (`triton.gemv.sum_splits`), so a row's bits depend neither on the other
rows nor on the routing of other tokens. Tiles past the routing's real count (expert -1) exit.

Not done (first version, not routed by the registry): the clamped SwiGLU on the W1/W3 outputs,
its FP8 re-quantisation as the W2 input, W2 itself through this kernel, and the weighted combine:
`moe_experts_decode` raises NotImplementedError naming them; `triton.moe.moe_experts` runs the
whole layer.

Measured (H200, one device call; NOTES.md "TileLang MoE decode, fifth session"): V4.1's W1 alone
(I=2304 x D=5120, 384 experts, top-6) in the engine's harness (one CUDA graph of 8 calls on 8
routings), the default schedule: T=1 35.7 us (24.8% of the copy ceiling on the routed experts'
W1 bytes), T=16 318.7 us (39.7%), bf16 out; the result within 2.5e-5 of the dequantised fp32
math (fp32 out, T=1). That is below Triton's fused W1/W3 kernel (~33% at T=1, ~50% at T=16 by
its node times): a first version, not routed.
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's argument annotations.

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..quant import e2m1_value, unpack_fp4
from . import lowering
from .decode_gemm import decode_tile_split
from .fp8_gemm import (
    BLOCK_K,
    MAX_SHARED_BYTES,
    OUT_DTYPES,
    SCALE_BLOCK,
    SLICES,
    WARPGROUP_ROWS,
    tma_ready,
)

if TYPE_CHECKING:  # importing triton/moe.py imports triton: only the type here
    from ..triton.moe import Routing

TILE_ROWS = 16  # routed rows per tile (the wgmma's N); `build_routing(..., block_m=TILE_ROWS)`
E4M3_SHIFT = 6  # the e4m3 placement is e2m1 * 2**-6: the promotion multiplies 2**6 back
TOPK = 6  # V4.1's experts per token: the split policy assumes one token's tiles (T=1)
WORDS_PER_TILE = BLOCK_K // 8  # int32 words of packed FP4 per weight row and K tile


@dataclass(frozen=True)
class MoeDecodeConfig:
    """One compiled kernel's schedule.

    split_k: K chunks (0: `moe_decode_split(N, K)`); each a multiple of 128.
    tile_rows: routed rows per tile, the wgmma's N (16 or 8): the routing must be built with
        `build_routing(..., block_m=tile_rows)`. 8 halves the promotion (4 instead of 8 values
        per thread and slice) and the activation bytes per stage; decode routes ~1-2 rows per
        expert tile at T <= 64. NOT RUN ON A GPU yet (lowering and SASS checked locally).
    num_stages: TMA ring depth (a stage: 64 x 64 B packed weights + 16 x 128 B activations +
        16 x 16 B activation scales; TileLang gives the e4m3 tile, written inside the pipelined
        loop, one copy per stage as well: 8 KB more).
    min_blocks: CTAs per SM asked of the compiler (`__launch_bounds__(256, min_blocks)`), with
        TileLang's setmaxnreg off when > 1 (52 registers per thread, local nvcc 13).
    one_wait: issue the K tile's four slice wgmmas back to back, each into its own partial, and
        wait once before promoting them in slice order (one wgmma latency per K tile instead of
        four; 80 registers per thread instead of 50 at 16 rows, so at most 3 CTAs per SM; 59 at
        8 rows). The same
        products and the same promotion order, so the same bits. NOT RUN ON A GPU yet
        (written after the session's one call; lowering-tested only): off by default. TileLang
        puts the e4m3 tile's proxy fence after the warpgroup barrier here (each thread fences,
        then issues its warp's part of the wgmma) where the default has it before (HOPPER.md's
        order): run `test_gpu_one_wait_same_bits` before relying on it.

    Default: 3 stages, 4 CTAs per SM, the fastest of the schedules measured (H200, one layer's
    W1, chained graph of 8 routings; NOTES.md "TileLang MoE decode, fifth session"): T=1 35.7 us,
    T=16 318.7 us, against 47.5 / 369.6 for 4 stages at 2 per SM and 48.7 / 367.0 at 3 per SM;
    the same bits in every schedule.
    """

    split_k: int = 0
    tile_rows: int = TILE_ROWS
    num_stages: int = 3
    min_blocks: int = 4
    one_wait: bool = False

    def __post_init__(self) -> None:
        if self.split_k < 0:
            raise ValueError(f"MoeDecodeConfig.split_k must be >= 0, got {self.split_k}")
        if self.tile_rows not in (8, 16):
            raise ValueError(f"MoeDecodeConfig.tile_rows must be 8 or 16, got {self.tile_rows}")
        if not 1 <= self.num_stages <= 12:
            raise ValueError(
                f"MoeDecodeConfig.num_stages must be in [1, 12], got {self.num_stages}"
            )
        if not 1 <= self.min_blocks <= 8:
            raise ValueError(f"MoeDecodeConfig.min_blocks must be in [1, 8], got {self.min_blocks}")
        if self.one_wait and self.tile_rows == 16 and self.min_blocks > 3:
            # 4 partials of 16 columns need ~80 registers (local ptxas); 4 CTAs per SM cap a
            # thread at 64 (at 8 rows: 59, so 4 CTAs fit)
            raise ValueError(
                "MoeDecodeConfig.one_wait with tile_rows=16 needs min_blocks <= 3, "
                f"got {self.min_blocks}"
            )

    def shared_bytes(self, k_chunk: int) -> int:
        """The TMA ring, the e4m3 weight tiles (one per stage) and the chunk's weight-scale
        bytes (e.g. 48 KB for V4.1's W1 at split 2: 4 CTAs fit an SM's 228 KB)."""
        packed = WARPGROUP_ROWS * BLOCK_K // 2
        stage = packed + 2 * packed + self.tile_rows * BLOCK_K + self.tile_rows * SLICES * 4
        return self.num_stages * stage + WARPGROUP_ROWS * (k_chunk // SCALE_BLOCK)


def moe_decode_split(n: int, k: int) -> int:
    """K chunks for [E, N, K] expert weights: a function of (N, K) only (batch invariance), sized
    so that one token's TOPK tiles fill the GPU twice over (the dense rule of `decode_tile_split`
    applied to TOPK x N rows): V4.1 W1/W3 (2304 x 5120) -> 2, W2 (5120 x 2304) -> 1."""
    return decode_tile_split(TOPK * n, k, WARPGROUP_ROWS)


def shape_reason(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> str | None:
    """Why the kernel cannot take these operands, or None."""
    if x_fp8.dtype != torch.float8_e4m3fn:
        return f"x_fp8 must be float8_e4m3fn, got {x_fp8.dtype}"
    if x_fp8.dim() != 2 or w.dim() != 3:
        return f"x_fp8 must be [T, K] and w [E, N, K/2], got {list(x_fp8.shape)}, {list(w.shape)}"
    t, k = x_fp8.shape
    e, n, kh = w.shape
    if w.dtype not in (torch.int8, torch.uint8):
        return f"w must be int8 or uint8 (packed e2m1 pairs), got {w.dtype}"
    if kh * 2 != k:
        return f"w must be [E, N, K/2] = [E, N, {k // 2}], got {list(w.shape)}"
    if k % BLOCK_K:
        return f"K must be a multiple of {BLOCK_K}, got {k}"
    if n % WARPGROUP_ROWS:
        return f"N must be a multiple of {WARPGROUP_ROWS} (tiles within one expert), got {n}"
    if list(x_scale.shape) != [t, k // SCALE_BLOCK] or x_scale.dtype != torch.float32:
        got = f"{x_scale.dtype} {list(x_scale.shape)}"
        return f"x_scale must be fp32 [{t}, {k // SCALE_BLOCK}], got {got}"
    if list(w_scale.shape) != [e, n, k // SCALE_BLOCK]:
        return f"w_scale must be [{e}, {n}, {k // SCALE_BLOCK}], got {list(w_scale.shape)}"
    if w_scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        return f"w_scale must be float8_e8m0fnu or uint8 (UE8M0 bytes), got {w_scale.dtype}"
    return None


def expand_e4m3_bytes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed e2m1 pairs -> [..., K] uint8 e4m3 bit patterns of e2m1 * 2**-6, the
    kernel's expansion per value: (code & 7) << 2 | (code & 8) << 4 (sign to bit 7)."""
    code = unpack_fp4(packed)
    return ((code & 7) << 2) | ((code & 8) << 4)


def promote_reference(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    rows_token: torch.Tensor,
    rows_expert: torch.Tensor,
    split: int,
) -> torch.Tensor:
    """The kernel's arithmetic in torch fp32, for CPU checks: for each routed row r (token
    rows_token[r] [R], expert rows_expert[r] [R]), per K chunk and 32-slice, the unscaled partial
    of the e4m3 expansion (`expand_e4m3_bytes`) and the FP8 activations, promoted with
    2**(u - 127 + 6) * sx, the chunks summed in ascending order. Returns [R, N] fp32."""
    k = x_fp8.shape[1]
    n = w.shape[1]
    r = rows_token.shape[0]
    wv = expand_e4m3_bytes(w).view(torch.float8_e4m3fn).float()  # [E, N, K]
    u = w_scale.contiguous().view(torch.uint8).to(torch.int32)  # [E, N, K/32]
    sw = ((u + E4M3_SHIFT) << 23).view(torch.float32)
    xs = x_fp8.float()[rows_token.long()]  # [R, K]
    sx = x_scale[rows_token.long()]  # [R, K/32]
    we = wv[rows_expert.long()]  # [R, N, K]
    swe = sw[rows_expert.long()]  # [R, N, K/32]
    chunk = k // split
    out = torch.zeros(r, n, dtype=torch.float32)
    for s in range(split):
        acc = torch.zeros(r, n, dtype=torch.float32)
        for kb in range(s * chunk // SCALE_BLOCK, (s + 1) * chunk // SCALE_BLOCK):
            ks = slice(kb * SCALE_BLOCK, (kb + 1) * SCALE_BLOCK)
            part = torch.einsum("rnk,rk->rn", we[:, :, ks], xs[:, ks])
            acc += part * (swe[:, :, kb] * sx[:, kb, None])
        out = acc if s == 0 else out + acc
    return out


def dequantized_reference(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    rows_token: torch.Tensor,
    rows_expert: torch.Tensor,
) -> torch.Tensor:
    """The MoE reference's math for the same rows: dequantised x [R, K] @ dequantised w^T, fp32.
    [R, N]. (The kernel must match it up to fp32 summation order.)"""
    xd = (x_fp8.float().unflatten(-1, (-1, SCALE_BLOCK)) * x_scale[..., None]).flatten(-2)
    values = e2m1_value(unpack_fp4(w)).unflatten(-1, (-1, SCALE_BLOCK))
    wd = (values * w_scale.float()[..., None]).flatten(-2)  # [E, N, K]
    return torch.einsum("rnk,rk->rn", wd[rows_expert.long()], xd[rows_token.long()])


# -- the kernel (tilelang imported here only) ----------------------------------------------------


def build_kernel(n: int, k: int, split: int, out_dtype: str, cfg: MoeDecodeConfig):
    """The TileLang prim_func for experts [E, n, k] cut into `split` K chunks (E, rows, tiles
    dynamic).

    Arguments: X [R, K] e4m3 and SX [R, K/32] fp32 (activation rows in routing order), W [E*N, K/8]
    int32 (packed e2m1 words), SW [E*N, K/32] uint8, TILES [tiles, 3] int32 (expert or -1, first
    row, end row), P: [split, R, N] fp32 partials when split > 1, else [R, N] out_dtype.
    """
    import tilelang.language as T

    if k % (split * BLOCK_K):
        raise ValueError(f"build_kernel: K={k} must split into {split} chunks of 128s")
    if out_dtype not in OUT_DTYPES.values():
        raise ValueError(f"build_kernel: out_dtype must be one of {list(OUT_DTYPES.values())}")
    bn, bt = WARPGROUP_ROWS, cfg.tile_rows
    kc = k // split
    kbc = kc // SCALE_BLOCK
    kb_total = k // SCALE_BLOCK
    kw = k // 8  # int32 words per packed weight row
    rows = T.dynamic("rows")
    wrows = T.dynamic("wrows")  # E * N
    ntiles = T.dynamic("ntiles")
    fp8 = "float8_e4m3fn"
    p_shape = (split, rows, n) if split > 1 else (rows, n)
    p_dtype = "float32" if split > 1 else out_dtype

    policy = T.GemmWarpPolicy.FullRow
    frag_regs = bn * bt // 128  # fp32 registers per thread of one partial

    @T.macro
    def promote(acc, part, sw_chunk, sx_tile, kt, s):
        """acc += part * 2**(u + 6 - 127) * sx on CUDA cores (the weight scale from its byte)."""
        for i, j in T.Parallel(bn, bt):
            u = T.Cast("uint32", sw_chunk[i, kt * SLICES + s])
            acc[i, j] += part[i, j] * (
                T.reinterpret(T.shift_left(u + E4M3_SHIFT, 23), "float32") * sx_tile[j, s]
            )

    @T.prim_func
    def moe_decode_kernel(
        X: T.Tensor((rows, k), fp8),
        SX: T.Tensor((rows, kb_total), "float32"),
        W: T.Tensor((wrows, kw), "int32"),
        SW: T.Tensor((wrows, kb_total), "uint8"),
        TILES: T.Tensor((ntiles, 3), "int32"),
        P: T.Tensor(p_shape, p_dtype),
    ):
        with T.Kernel(ntiles, n // bn, split, threads=128) as (bx, by, bz):
            wq_tile = T.alloc_shared((bn, WORDS_PER_TILE), "int32")
            x_tile = T.alloc_shared((bt, BLOCK_K), fp8)
            sx_tile = T.alloc_shared((bt, SLICES), "float32")
            w_tile = T.alloc_shared((bn, BLOCK_K), fp8)
            sw_chunk = T.alloc_shared((bn, kbc), "uint8")
            acc = T.alloc_fragment((bn, bt), "float32")
            nparts = SLICES if cfg.one_wait else 1
            parts = tuple(T.alloc_fragment((bn, bt), "float32") for _ in range(nparts))
            if cfg.min_blocks > 1:
                T.annotate_min_blocks_per_sm(cfg.min_blocks)
                T.no_set_max_nreg()
            from tilelang.layout import make_full_bank_swizzled_layout as row_swizzled

            T.annotate_layout({w_tile: row_swizzled(w_tile), x_tile: row_swizzled(x_tile)})
            expert = TILES[bx, 0]
            first = TILES[bx, 1]
            end = TILES[bx, 2]
            wrow0 = expert * n + by * bn
            if expert >= 0:
                T.clear(acc)
                for r, c in T.Parallel(bn, kbc):
                    sw_chunk[r, c] = SW[wrow0 + r, bz * kbc + c]
                for kt in T.Pipelined(kc // BLOCK_K, num_stages=cfg.num_stages):
                    T.copy(W[wrow0, (bz * kc + kt * BLOCK_K) // 8], wq_tile)
                    T.copy(X[first, bz * kc + kt * BLOCK_K], x_tile)
                    T.copy(SX[first, bz * kbc + kt * SLICES], sx_tile)
                    # e2m1 nibble -> e4m3 byte of value * 2**-6: magnitude to bits 4..2, sign to 7.
                    # Written per output byte, but on whole words: each thread expands one packed
                    # word (8 values; T.Parallel vectorises c by 8): the even values' nibbles
                    # (a mask) and the odd ones' (a shift and a mask) placed 4 at a time, the two
                    # placed words interleaved bytewise (PRMT) into the 8 output bytes, of which
                    # lane c takes byte c; nvcc shares the words across the 8 lanes.
                    for i, c in T.Parallel(bn, BLOCK_K):
                        word = wq_tile[i, c // 8]
                        even = word & 0x0F0F0F0F
                        odd = T.shift_right(word, 4) & 0x0F0F0F0F
                        placed_even = T.shift_left(even & 0x07070707, 2) | T.shift_left(
                            even & 0x08080808, 4
                        )
                        placed_odd = T.shift_left(odd & 0x07070707, 2) | T.shift_left(
                            odd & 0x08080808, 4
                        )
                        # bytes (e0 o0 e1 o1) for c < 4, (e2 o2 e3 o3) for c >= 4
                        pair = T.call_extern(
                            "int32", "__byte_perm", placed_even, placed_odd,
                            0x5140 + (c % 8 // 4) * 0x2222,  # 0x7362 for c % 8 >= 4
                        )  # fmt: skip
                        w_tile[i, c] = T.reinterpret(
                            T.Cast("uint8", T.shift_right(pair, (c % 4) * 8) & 0xFF), fp8
                        )
                    if cfg.one_wait:
                        for s in tuple(range(SLICES)):
                            T.wgmma_gemm(
                                w_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
                                x_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
                                parts[s], transpose_B=True, clear_accum=True, policy=policy,
                            )  # fmt: skip
                        T.wait_wgmma(0)
                        # a stage goes back to the producer after the last statement touching
                        # its buffers, and the issued wgmmas read them until the wait: keep the
                        # hand-back after it (as decode_gemm.py's depth 2)
                        T.evaluate(T.address_of(x_tile[0, 0]))
                        for s in tuple(range(SLICES)):
                            T.warpgroup_fence_operand(parts[s], num_regs=frag_regs)
                            promote(acc, parts[s], sw_chunk, sx_tile, kt, s)
                    else:
                        for s in T.unroll(SLICES):
                            T.gemm(
                                w_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
                                x_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
                                parts[0], transpose_B=True, clear_accum=True, policy=policy,
                            )  # fmt: skip
                            promote(acc, parts[0], sw_chunk, sx_tile, kt, s)
                for i, j in T.Parallel(bn, bt):
                    row = first + j
                    if row < end:
                        if split > 1:
                            P[bz, row, by * bn + i] = acc[i, j]
                        else:
                            P[row, by * bn + i] = T.Cast(out_dtype, acc[i, j])

    return moe_decode_kernel


def lower_source(n: int, k: int, split: int, out_dtype: str = "float32", cfg=None) -> str:
    """CUDA source of the kernel for sm_90a, lowered without nvcc (inspection and CPU tests)."""
    cfg = cfg or MoeDecodeConfig()
    return lowering.lower_source(build_kernel(n, k, split, out_dtype, cfg), True)


# one kernel per (N, K, split, out dtype, config); the routed rows are dynamic; 128-B rows always
_KERNELS = lowering.KernelCache("TileLang MoE decode GEMM", build_kernel)


def moe_decode_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    routing: "Routing",
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    config: MoeDecodeConfig | None = None,
) -> torch.Tensor:
    """Grouped GEMM over a routing's tiles: x_fp8 [T, K] e4m3 with x_scale [T, K/32] fp32 powers
    of two, w [E, N, K/2] packed e2m1 with w_scale [E, N, K/32] UE8M0 -> [P, N] out_dtype, row r
    = routed pair r in routing order (token routing.sorted_token[r], its tile's expert), fp32
    accumulation. `routing` from `triton.moe.build_routing(..., block_m=TILE_ROWS)`.

    Hopper's TMA cannot gather rows, so the activation rows are first put in routing order (two
    small gathers), then `grouped_gemm_sorted`. Capturable in a CUDA graph (no host reads: the
    tile list's length is a host-side bound)."""
    why = shape_reason(x_fp8, x_scale, w, w_scale)
    if why is not None:
        raise ValueError(f"tilelang moe_decode_gemm: {why}")
    tok = routing.sorted_token.long()
    # gathered as bytes: index kernels need not know fp8
    xr = x_fp8.view(torch.uint8)[tok].view(torch.float8_e4m3fn)
    return grouped_gemm_sorted(xr, x_scale[tok], routing.tiles, w, w_scale, out_dtype, config)


def grouped_gemm_sorted(
    x_rows: torch.Tensor,
    x_rows_scale: torch.Tensor,
    tiles: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    config: MoeDecodeConfig | None = None,
) -> torch.Tensor:
    """The kernel on activation rows already in routing order (as the W2 input is: the SwiGLU
    output of the sorted rows): x_rows [P, K] e4m3, x_rows_scale [P, K/32] fp32, tiles
    [tiles, 3] int32 (expert or -1, first row, end row; `Routing.tiles` of TILE_ROWS-row tiles),
    w [E, N, K/2], w_scale [E, N, K/32] -> [P, N] out_dtype (rows in no tile are not written)."""
    why = shape_reason(x_rows, x_rows_scale, w, w_scale)
    if why is not None:
        raise ValueError(f"tilelang grouped_gemm_sorted: {why}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {list(OUT_DTYPES)}, got {out_dtype}")
    if tiles.dim() != 2 or tiles.shape[1] != 3 or tiles.dtype != torch.int32:
        raise ValueError(f"tiles must be int32 [tiles, 3], got {tiles.dtype} {list(tiles.shape)}")
    p, k = x_rows.shape
    e, n, _ = w.shape
    cfg = config or MoeDecodeConfig()
    split = cfg.split_k or moe_decode_split(n, k)
    if k % (split * BLOCK_K):
        raise ValueError(f"tilelang grouped_gemm_sorted: split_k={split} must cut K={k} into 128s")
    if cfg.shared_bytes(k // split) > MAX_SHARED_BYTES:
        raise ValueError(f"tilelang grouped_gemm_sorted: {cfg} needs too much shared memory")
    if p == 0 or n == 0 or tiles.shape[0] == 0:
        return torch.empty(p, n, dtype=out_dtype, device=x_rows.device)
    xr, sxr = tma_ready(x_rows), tma_ready(x_rows_scale)
    wq = tma_ready(w.view(torch.uint8).reshape(e * n, k // 2)).view(torch.int32)
    # the scale bytes are read 4 at a time (16-B aligned base: tma_ready copies otherwise)
    sw = tma_ready(w_scale.view(torch.uint8).reshape(e * n, k // SCALE_BLOCK))
    tiles = tiles.contiguous()
    if split == 1:
        out = torch.empty(p, n, dtype=out_dtype, device=x_rows.device)
        _KERNELS.get((n, k, 1, OUT_DTYPES[out_dtype], cfg), True)(xr, sxr, wq, sw, tiles, out)
        return out
    partials = torch.empty(split, p, n, dtype=torch.float32, device=x_rows.device)
    _KERNELS.get((n, k, split, "float32", cfg), True)(xr, sxr, wq, sw, tiles, partials)
    from ..triton.gemv import sum_splits

    return sum_splits(partials, out_dtype)


def moe_experts_decode(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The whole routed-expert layer on this kernel: not done in this first version."""
    raise NotImplementedError(
        "tilelang moe_experts_decode: only the grouped W1/W3 GEMM exists (moe_decode_gemm); the "
        "clamped SwiGLU, its FP8 re-quantisation as the W2 input, W2 through moe_decode_gemm and "
        "the weighted combine are not written: use triton.moe.moe_experts"
    )
