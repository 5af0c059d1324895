"""TileLang swap-AB FP8 decode GEMM for V4.1's block-scaled format on Hopper (sm_90a), M <= 64.

out[M, N] = sum_k (x[m, k] * sx[m, k // 32]) * (w[n, k] * sw[n // 32, k // 32]), fp32 accumulation,
with x [M, K] e4m3, sx [M, K/32] fp32 powers of two, w [N, K] e4m3, sw [ceil(N/32), K/32] UE8M0.

Why a second kernel: at decode sizes the op streams the weight (42 MB for 5120x8192) and does
almost no arithmetic. The Triton swap kernel (`triton/gemv.py`) converts and stores the activation
tile to shared memory every K step behind block barriers, and that per-step chain bounds it
(~30% of HBM at M=2..16, NOTES.md). Here the weight is the wgmma's A operand (64 weight rows per
consumer warpgroup, straight from TMA'd shared memory, FP8 as stored: no conversion), the tokens
are its B operand (N = `block_t`, 16..64 rows, zero-filled by TMA past M), and TileLang
warp-specialises the K loop: one producer warpgroup issues the TMA loads of a `num_stages`-deep
ring of 128-deep K tiles, the consumer waits only on mbarriers. Per 32-slice one
``wgmma.m64n{block_t}k32`` makes an unscaled partial, promoted on CUDA cores:
``acc[n, m] += part[n, m] * (sw[n // 32, kb] * sx[m, kb])`` (the prefill kernel's scheme,
`fp8_gemm.py`, with the operands swapped).

The weight scales are not TMA'd per stage (a 2-row x 4-byte box is below TMA's 16-B minimum and the
fp32 copy the prefill kernel takes would cost a conversion kernel per call): the CTA copies its
whole K range of UE8M0 bytes (block_n/32 rows x K-chunk/32) to shared memory once, before the
loop, and each promotion turns a byte into 2**(e - 127) with a shift (exact; e = 0, the subnormal
2**-127, is read as 0 here: quantisation never produces it).

K is split into `split` equal chunks (a multiple of 128 each) chosen from (N, K) only
(`decode_tile_split`), one CTA per (token tile, weight tile, chunk); the chunks' fp32 partials are
summed in ascending order by `triton.gemv.sum_splits` (or inside the kernel: `fused_sum`, the same
bits). Nothing depends on M except the grid's token tiles, and a wgmma column's result does not
depend on the wgmma's N (GPU-tested bitwise: token tiles of 16 / 32 / 64, M = 1 .. 300), so a
row's bits do not depend on the other rows: batch-invariant mode runs this kernel at every M.

Measured on the H200 (NOTES.md, "Dense decode, fifth session"; 16 consecutive calls on 16 weight
sets in one CUDA graph, as the engine's decode graph runs layers), 5120x8192 (42 MB): M=1 / 16
16.3 us (60% of the 4.25 TB/s copy ceiling; a bare streaming read of the same bytes: 11.7 us),
M=32 18.5 us (53%), M=64 24.7 us (40%); the fourth session's schedule (2 CTAs per SM, 6 stages)
17.1 / 25.9 / 33.0 us in the same run, the Triton swap kernel before it 28 / - / 48 us. Prefill
sizes in invariant mode (fourth session): 234-279 TFLOP/s (M=256..8192).
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's argument annotations.

import dataclasses
from dataclasses import dataclass

import torch

from . import lowering
from .fp8_gemm import (
    BLOCK_K,
    MAX_SHARED_BYTES,
    OUT_DTYPES,
    SCALE_BLOCK,
    SLICES,
    WARPGROUP_ROWS,
    tma_ready,
)
from .fp8_gemm import shape_reason as prefill_shape_reason

PRODUCER_REGS = 24  # registers the TMA-issuing warpgroup keeps under `consumer_regs` (setmaxnreg)
NUM_SMS = 132  # H200: the split policy's target (a constant: the split is a function of (N, K))


_FIELD_LIMITS = (
    ("block_n", "64 or 128", lambda v: v in (64, 128)),
    ("block_t", "one of 8, 16, 32, 64", lambda v: v in (8, 16, 32, 64)),
    ("split_k", ">= 0", lambda v: v >= 0),
    ("num_stages", "in [1, 12]", lambda v: 1 <= v <= 12),
    ("min_blocks", "in [1, 8]", lambda v: 1 <= v <= 8),
    ("depth", "1 or 2", lambda v: v in (1, 2)),
    (
        "consumer_regs",
        "0 or a multiple of 8 in [64, 240]",
        lambda v: v == 0 or (v % 8 == 0 and 64 <= v <= 240),
    ),
    ("token_groups", "1 or 2", lambda v: v in (1, 2)),
)
"""`DecodeTileConfig`'s limits one field at a time: (field, allowed values as the error states
them, the check). The checks that join fields follow them in `__post_init__`."""


@dataclass(frozen=True)
class DecodeTileConfig:
    """One compiled decode kernel's tile and schedule.

    block_n: weight rows per CTA (64 or 128: one consumer warpgroup per 64).
    block_t: token rows per CTA, the wgmma's N (8, 16, 32 or 64); M is tiled by it.
    split_k: K chunks (0: `decode_tile_split(N, K)`); each chunk a multiple of 128.
    num_stages: TMA ring depth (each stage (block_n + block_t) x 128 B + block_t x 16 B).
    min_blocks: CTAs per SM asked of the compiler (``__launch_bounds__(threads, min_blocks)``,
        which caps every thread at 65536 / (min_blocks x threads) registers), with TileLang's
        per-warpgroup register re-allocation (setmaxnreg 24 / 240) switched off unless
        `consumer_regs` asks for it: the consumer needs few registers (block_t/2 fp32 per
        partial and per accumulator per thread), and at one CTA per SM (TileLang's default) a
        42 MB weight gets 2.4 waves of 320 CTAs with only num_stages K tiles in flight per SM.
        Whether min_blocks CTAs really fit also depends on shared memory (`shared_bytes`, plus
        1 KB the hardware reserves per CTA, within 228 KB per SM).
    row_swizzle: K tiles as 128-B rows with the 128-B swizzle (one TMA box per operand and stage,
        each slice's wgmma 32 B further inside the swizzle atom), through the prefill kernel's
        `lowering.row_swizzle_lowering`; off, TileLang gives each 32-wide slice its own
        32-B-swizzled sub-tile (four TMA boxes of 32-B rows per operand and stage): measured on
        the H200 (5120x8192, M=16, 16-call graph) 17.3 us with, 21.6 without.
    depth: wgmmas in flight per consumer (1: issue, wait, promote each 32-slice; 2: slice s+1's
        wgmma is issued before slice s is promoted, each into its own partial).
    fused_sum: with split > 1 and one token tile (M <= block_t), the chunks' partials are summed
        inside the kernel instead of by a second kernel: each consumer thread writes its partial
        elements, then counts itself in on a per-(weight tile, thread) counter (device-scope
        acq_rel atomic); the thread that arrives last for its slot (the same fragment positions
        in every chunk's CTA) adds the chunks' values in ascending chunk order, as `sum_splits`
        does (bitwise the same result), stores the output and resets the counter to 0 for the
        next call. One graph node instead of two.
    consumer_regs: 0, or setmaxnreg with min_blocks CTAs per SM: the producer warpgroup drops to
        PRODUCER_REGS registers and the consumers raise theirs to consumer_regs, so a consumer
        that needs more than the launch cap (e.g. 127 at 64 tokens, depth 2) still fits
        min_blocks CTAs per SM (min_blocks x (128 x PRODUCER_REGS + threads x consumer_regs)
        <= 65536).
    token_groups: consumer warpgroups along the tokens (1 or 2; block_n=64): with 2, two
        warpgroups share each stage's weight tile, each issues the m64 x block_t/2 x k32 wgmma
        of its half of the tokens and promotes half the values (TileLang's FullRow policy puts
        8 warps on a 64-row tile as 4 x 2). A column's bits do not depend on the wgmma's N, so
        the result is the same; the promotion chain per warp halves and twice the warps run it.
    """

    block_n: int = 64
    block_t: int = 16
    split_k: int = 0
    num_stages: int = 6
    min_blocks: int = 2
    row_swizzle: bool = True
    depth: int = 1
    fused_sum: bool = False
    consumer_regs: int = 0
    token_groups: int = 1

    def __post_init__(self) -> None:
        for name, allowed, ok in _FIELD_LIMITS:
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"DecodeTileConfig.{name} must be {allowed}, got {value}")
        if self.token_groups == 2 and (self.block_n != WARPGROUP_ROWS or self.block_t < 16):
            raise ValueError(
                "DecodeTileConfig.token_groups=2 needs block_n=64 and block_t >= 16, "
                f"got block_n={self.block_n}, block_t={self.block_t}"
            )
        per_sm = self.min_blocks * (128 * PRODUCER_REGS + self.threads * self.consumer_regs)
        if self.consumer_regs and per_sm > 65536:
            raise ValueError(
                f"DecodeTileConfig.consumer_regs={self.consumer_regs} with min_blocks="
                f"{self.min_blocks} needs {per_sm} registers per SM (> 65536)"
            )

    @property
    def threads(self) -> int:
        """Consumer threads (TileLang adds one producer warpgroup)."""
        return self.block_n // WARPGROUP_ROWS * self.token_groups * 128

    def shared_bytes(self, k_chunk: int) -> int:
        """Ring of operand and activation-scale stages, plus the chunk's weight-scale bytes."""
        stage = (self.block_n + self.block_t) * BLOCK_K + self.block_t * SLICES * 4
        return self.num_stages * stage + (self.block_n // SCALE_BLOCK) * (k_chunk // SCALE_BLOCK)


def decode_tile_split(n: int, k: int, block_n: int = 64) -> int:
    """K chunks for an [N, K] weight: a function of (N, K) only. Doubles from 1 while there are
    fewer than 2 CTAs per SM (weight tiles x chunks), a chunk keeps >= 1024 columns and stays a
    multiple of 128 (whole pipeline stages)."""
    tiles = -(-n // block_n)
    s = 1
    while tiles * s < 2 * NUM_SMS and k % (2 * s * BLOCK_K) == 0 and k // (2 * s) >= 1024:
        s *= 2
    return s


FUSED_SUM = False
"""`pick_tile_config` sums the K chunks inside the kernel (`DecodeTileConfig.fused_sum`). Off:
measured on the H200 (16-call graphs, 5120x8192) it saves 0.3 us at M=1/2 (16.9 vs 17.2 us), costs
1 us at M=16 and 9 us at M=64 (the last thread of a slot sums block_t/2 elements x 4 chunks
alone)."""


def pick_tile_config(m: int, n: int, k: int) -> DecodeTileConfig:
    """Token tile from M (the smallest of 16 / 32 / 64 that holds M; larger M takes several 64-row
    tiles), weight tile 64 rows, split from (N, K); the schedule from the token tile and the CTA
    count (token tiles x weight tiles x chunks), so that every CTA of a decode call is resident
    at once (H200, 16-call graphs, NOTES.md "Dense decode, fifth session"; us against the fourth
    session's 2 CTAs per SM and 6 stages, same run):
    - 16 and 32 tokens: 4 CTAs per SM, 4-stage ring (5120x8192: 16.3 vs 17.1 us at M=16, 18.5
      vs 25.9 at M=32; 32768x1280 M=16: 14.6 vs 16.9);
    - 64 tokens, more CTAs than SMs: 4 per SM, 3 stages, setmaxnreg 24 / 104 (127 registers do
      not fit 4 CTAs; one wgmma in flight fits 104): 24.7 vs 33.0 us at 5120x8192 (320 CTAs,
      1.2 waves at 2 per SM), 20.6 vs 24.3 at 32768x1280 (512 CTAs);
    - 64 tokens, at most one CTA per SM (2112x7168: 132): two consumer warpgroups, 32 tokens
      each (`token_groups`), 4 stages, 3 per SM asked: 13.7 vs 15.4 us (the first candidate,
      two wgmmas in flight at 3 per SM with setmaxnreg 24 / 136: 14.9).
    Invariant mode at prefill sizes (many token tiles) therefore takes the 4-per-SM schedule
    (not timed there). The sum of the chunks as FUSED_SUM says. None of this changes a bit of the
    result (GPU-tested: each schedule bitwise against the fourth session's)."""
    bt = 16 if m <= 16 else 32 if m <= 32 else 64
    split = decode_tile_split(n, k)
    ctas = -(-m // bt) * -(-n // WARPGROUP_ROWS) * split
    if bt < 64:
        schedule = dict(num_stages=4, min_blocks=4)
    elif ctas > NUM_SMS:
        schedule = dict(num_stages=3, min_blocks=4, consumer_regs=104)
    else:
        schedule = dict(num_stages=4, min_blocks=3, token_groups=2)
    return DecodeTileConfig(block_t=bt, split_k=split, fused_sum=FUSED_SUM, **schedule)


def shape_reason(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> str | None:
    """Why the kernel cannot take these operands, or None: the prefill kernel's limits (K a
    multiple of 128: whole stages, 16-B aligned TMA row strides for the scales), and w_scale
    [ceil(N/32), K/32] (this kernel reads its bytes directly)."""
    why = prefill_shape_reason(x_fp8, x_scale, w, w_scale)
    if why is not None:
        return why
    k = x_fp8.shape[1]
    rows = -(-w.shape[0] // SCALE_BLOCK)
    if list(w_scale.shape) != [rows, k // SCALE_BLOCK]:
        return f"w_scale must be [{rows}, {k // SCALE_BLOCK}], got {list(w_scale.shape)}"
    return None


def weight_scale_bytes(w_scale: torch.Tensor) -> torch.Tensor:
    """w_scale [ceil(N/32), K/32] as UE8M0 bytes (uint8): a view for e8m0, the exponent field for
    fp32 powers of two (exact for every normal power of two)."""
    if w_scale.dtype == torch.float8_e8m0fnu:
        return w_scale.view(torch.uint8).contiguous()
    if w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be float8_e8m0fnu or float32, got {w_scale.dtype}")
    return ((w_scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def promote_reference(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    split: int,
) -> torch.Tensor:
    """The kernel's arithmetic in torch fp32, for CPU checks of the host logic: per K chunk and
    32-slice, the unscaled partial w[:, slice] @ x[:, slice]^T promoted with the slice's two
    scales (decoded from the bytes as the kernel decodes them), then the chunks summed in
    ascending order. Returns [M, N] fp32."""
    m, k = x_fp8.shape
    n = w.shape[0]
    e = weight_scale_bytes(w_scale).to(torch.int32)
    sw = torch.where(e == 0, 0, (e << 23)).view(torch.float32)  # 2**(e-127), e=0 read as 0
    row_block = torch.arange(n) // SCALE_BLOCK
    a = x_fp8.float()
    b = w.float()
    chunk = k // split
    parts = []
    for s in range(split):
        acc = torch.zeros(n, m, dtype=torch.float32)
        for kb in range(s * chunk // 32, (s + 1) * chunk // 32):
            ks = slice(kb * 32, (kb + 1) * 32)
            part = b[:, ks] @ a[:, ks].t()
            acc += part * (sw[row_block, kb][:, None] * x_scale[:, kb][None, :])
        parts.append(acc)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out.t().contiguous()


# -- the kernel (tilelang imported here only) ----------------------------------------------------


def build_kernel(n: int, k: int, split: int, out_dtype: str, cfg: DecodeTileConfig):
    """The TileLang prim_func for weight [n, k] cut into `split` K chunks (M dynamic).

    Arguments: X [M, K] e4m3, SX [M, K/32] fp32, W [N, K] e4m3, SW [ceil(N/32), K/32] uint8
    (UE8M0 bytes), P: [split, M, N] fp32 partials when split > 1, else C [M, N] out_dtype.
    """
    import tilelang.language as T

    if k % (split * BLOCK_K):
        raise ValueError(f"build_kernel: K={k} must split into {split} chunks of 128s")
    if out_dtype not in OUT_DTYPES.values():
        raise ValueError(f"build_kernel: out_dtype must be one of {list(OUT_DTYPES.values())}")
    bn, bt = cfg.block_n, cfg.block_t
    kc = k // split
    kbc = kc // SCALE_BLOCK  # scale groups per chunk
    bn_blocks = bn // SCALE_BLOCK
    kb_total = k // SCALE_BLOCK
    sw_rows = -(-n // SCALE_BLOCK)
    m = T.dynamic("m")
    fp8 = "float8_e4m3fn"
    policy = T.GemmWarpPolicy.FullRow
    p_shape = (split, m, n) if split > 1 else (m, n)
    p_dtype = "float32" if split > 1 else out_dtype
    fused = cfg.fused_sum and split > 1
    all_threads = cfg.threads + 128  # TileLang's producer warpgroup comes first
    n_tiles = -(-n // bn)

    # fp32 registers per thread of one partial (each token group holds block_t / groups columns)
    frag_regs = WARPGROUP_ROWS * bt // (128 * cfg.token_groups)

    @T.macro
    def issue(w_tile, x_tile, part, s):
        """part = w[:, slice s] @ x[:, slice s]^T: one m64 x block_t x k32 wgmma, not waited."""
        T.wgmma_gemm(
            w_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
            x_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
            part, transpose_B=True, clear_accum=True, policy=policy,
        )  # fmt: skip

    @T.macro
    def promote(acc, part, sw_chunk, sx_tile, kt, s):
        """acc += part * 2**(e_w - 127) * sx on CUDA cores (the weight scale from its byte)."""
        for i, j in T.Parallel(bn, bt):
            e = T.Cast("uint32", sw_chunk[i // SCALE_BLOCK, kt * SLICES + s])
            acc[i, j] += part[i, j] * (
                T.reinterpret(T.shift_left(e, 23), "float32") * sx_tile[j, s]
            )

    @T.prim_func
    def decode_gemm_kernel(
        X: T.Tensor((m, k), fp8),
        SX: T.Tensor((m, kb_total), "float32"),
        W: T.Tensor((n, k), fp8),
        SW: T.Tensor((sw_rows, kb_total), "uint8"),
        P: T.Tensor(p_shape, p_dtype),
        C: T.Tensor((m, n), out_dtype),
        CNT: T.Tensor((n_tiles * all_threads,), "int32"),
    ):
        with T.Kernel(T.ceildiv(m, bt), T.ceildiv(n, bn), split, threads=cfg.threads) as (
            bx,
            by,
            bz,
        ):
            w_tile = T.alloc_shared((bn, BLOCK_K), fp8)
            x_tile = T.alloc_shared((bt, BLOCK_K), fp8)
            sx_tile = T.alloc_shared((bt, SLICES), "float32")
            sw_chunk = T.alloc_shared((bn_blocks, kbc), "uint8")
            acc = T.alloc_fragment((bn, bt), "float32")
            parts = tuple(T.alloc_fragment((bn, bt), "float32") for _ in range(cfg.depth))
            if cfg.min_blocks > 1:
                T.annotate_min_blocks_per_sm(cfg.min_blocks)
            if cfg.consumer_regs:
                T.annotate_producer_reg_dealloc(PRODUCER_REGS)
                T.annotate_consumer_reg_alloc(cfg.consumer_regs)
            elif cfg.min_blocks > 1:
                T.no_set_max_nreg()
            if cfg.row_swizzle:
                from tilelang.layout import make_full_bank_swizzled_layout as row_swizzled

                T.annotate_layout({w_tile: row_swizzled(w_tile), x_tile: row_swizzled(x_tile)})
            T.clear(acc)
            # the chunk's weight-scale bytes, once (rows past ceil(N/32) are never read for a
            # stored output: the store clips rows >= N)
            for r, c in T.Parallel(bn_blocks, kbc):
                row = by * bn_blocks + r
                sw_chunk[r, c] = T.if_then_else(row < sw_rows, SW[row, bz * kbc + c], 0)
            for kt in T.Pipelined(kc // BLOCK_K, num_stages=cfg.num_stages):
                T.copy(W[by * bn, bz * kc + kt * BLOCK_K], w_tile)
                T.copy(X[bx * bt, bz * kc + kt * BLOCK_K], x_tile)
                T.copy(SX[bx * bt, bz * kbc + kt * SLICES], sx_tile)
                if cfg.depth == 1:  # T.gemm issues the slice's wgmma and waits for it
                    for s in T.unroll(SLICES):
                        T.gemm(
                            w_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
                            x_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
                            parts[0], transpose_B=True, clear_accum=True, policy=policy,
                        )  # fmt: skip
                        promote(acc, parts[0], sw_chunk, sx_tile, kt, s)
                else:
                    # slice s's wgmma into partial s % 2, then promote slice s-1 under it
                    for s in tuple(range(SLICES)):
                        issue(w_tile, x_tile, parts[s % 2], s)
                        if s >= 1:
                            T.wait_wgmma(1)
                            T.warpgroup_fence_operand(parts[(s - 1) % 2], num_regs=frag_regs)
                            promote(acc, parts[(s - 1) % 2], sw_chunk, sx_tile, kt, s - 1)
                    T.wait_wgmma(0)
                    # a stage goes back to the producer after the last statement touching its
                    # buffers, and an issued wgmma still reads them: keep the hand-back after
                    # the wait (as in fp8_gemm.py)
                    T.evaluate(T.address_of(w_tile[0, 0]))
                    T.evaluate(T.address_of(x_tile[0, 0]))
                    last = SLICES - 1
                    T.warpgroup_fence_operand(parts[last % 2], num_regs=frag_regs)
                    promote(acc, parts[last % 2], sw_chunk, sx_tile, kt, last)
            for i, j in T.Parallel(bn, bt):
                row = bx * bt + j
                col = by * bn + i
                if row < m:  # noqa: SIM102 (nested: one TIR condition each)
                    if col < n:
                        if split > 1:
                            P[bz, row, col] = acc[i, j]
                        else:
                            P[row, col] = T.Cast(out_dtype, acc[i, j])
            if fused:
                # count this thread's partial in; the last of its slot sums every chunk's
                slot = by * all_threads + T.get_thread_binding()
                prev = T.alloc_var("int32")
                prev = T.atomic_add(CNT[slot], 1, memory_order="acq_rel", return_prev=True)
                if prev == split - 1:
                    # the loop reads acc (its own chunk's value, equal to what it stored), which
                    # binds it to acc's fragment layout: each thread visits exactly the positions
                    # it wrote, as did its counterparts in the other chunks' CTAs
                    for i, j in T.Parallel(bn, bt):
                        row = bx * bt + j
                        col = by * bn + i
                        if row < m:  # noqa: SIM102
                            if col < n:
                                total = T.alloc_var("float32")
                                total = T.if_then_else(bz == 0, acc[i, j], P[0, row, col])
                                for c in T.serial(1, split):
                                    total = total + T.if_then_else(
                                        bz == c, acc[i, j], P[c, row, col]
                                    )
                                C[row, col] = T.Cast(out_dtype, total)
                    CNT[slot] = 0

    return decode_gemm_kernel


def lower_source(
    n: int, k: int, split: int, out_dtype: str = "float32", cfg: DecodeTileConfig | None = None
) -> str:
    """CUDA source of the kernel for sm_90a, lowered without nvcc (inspection and CPU tests)."""
    cfg = cfg or DecodeTileConfig()
    return lowering.lower_source(build_kernel(n, k, split, out_dtype, cfg), cfg.row_swizzle)


# one kernel per (N, K, split, out dtype, config); M is a dynamic argument
_KERNELS = lowering.KernelCache("TileLang decode GEMM", build_kernel)


def decode_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: DecodeTileConfig | None = None,
    *,
    shapes_checked: bool = False,
) -> torch.Tensor:
    """x_fp8 [M, K] e4m3 with x_scale [M, K/32] fp32 powers of two, w [N, K] e4m3 with w_scale
    [ceil(N/32), K/32] e8m0 (or fp32 powers of two) -> [M, N] out_dtype, fp32 accumulation.

    Capturable in a CUDA graph (no host reads). With split > 1 the fp32 partials [split, M, N]
    are summed in ascending chunk order, inside the kernel (`DecodeTileConfig.fused_sum`, one
    token tile) or by a second kernel (`triton.gemv.sum_splits`): the same bits either way.
    `shapes_checked`: the caller already found `shape_reason` None for these operands (it routed
    the call on it: `triton.linear`), so a call checks them once; the output dtype and the
    configuration are checked here either way.
    """
    if not shapes_checked:
        why = shape_reason(x_fp8, x_scale, w, w_scale)
        if why is not None:
            raise ValueError(f"tilelang decode_gemm: {why}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {list(OUT_DTYPES)}, got {out_dtype}")
    m, k = x_fp8.shape
    n = w.shape[0]
    cfg = config or pick_tile_config(m, n, k)
    split = cfg.split_k or decode_tile_split(n, k, cfg.block_n)
    if k % (split * BLOCK_K):
        raise ValueError(f"tilelang decode_gemm: split_k={split} must cut K={k} into 128s")
    if cfg.shared_bytes(k // split) > MAX_SHARED_BYTES:
        raise ValueError(f"tilelang decode_gemm: {cfg} needs too much shared memory")
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    sw = tma_ready(weight_scale_bytes(w_scale))
    xq, xs, wq = tma_ready(x_fp8), tma_ready(x_scale), tma_ready(w)
    n_counters = -(-n // cfg.block_n) * (cfg.threads + 128)
    counters = None
    if cfg.fused_sum and split > 1 and m <= cfg.block_t:
        counters = arrival_counters(x_fp8.device, n_counters)
    if counters is None:  # no in-kernel sum: compile (and key) the kernel without it
        if cfg.fused_sum:  # (a new frozen config per call costs host time: only when needed)
            cfg = dataclasses.replace(cfg, fused_sum=False)
        unused = torch.empty(n_counters, dtype=torch.int32, device=x_fp8.device)
    out_name = OUT_DTYPES[out_dtype]
    if split == 1:
        out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
        _KERNELS.get((n, k, 1, out_name, cfg), cfg.row_swizzle)(xq, xs, wq, sw, out, out, unused)
        return out
    partials = torch.empty(split, m, n, dtype=torch.float32, device=x_fp8.device)
    if counters is not None:
        out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
        kernel = _KERNELS.get((n, k, split, out_name, cfg), cfg.row_swizzle)
        kernel(xq, xs, wq, sw, partials, out, counters)
        return out
    from ..triton.gemv import sum_splits

    # C is not written without the in-kernel sum: the fp32 partials' first slice stands in
    kernel = _KERNELS.get((n, k, split, "float32", cfg), cfg.row_swizzle)
    kernel(xq, xs, wq, sw, partials, partials[0], unused)
    return sum_splits(partials, out_dtype)


# Arrival counters of the in-kernel sum, per (device, length): zeros, and every call leaves them
# zero again (the last thread of each slot resets its counter), so consecutive calls on one
# stream (a decode graph) share them. Created outside graph capture only (a capture would record
# the zero fill instead of running it); two calls on one device must not run concurrently.
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, length: int) -> torch.Tensor | None:
    """The zeroed int32 counters [length] of `DecodeTileConfig.fused_sum` on `device`, or None
    while a CUDA graph is being captured and they do not exist yet (the caller then sums the
    partials with a second kernel: the same bits)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), length)
    buf = _COUNTERS.get(key)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[key] = torch.zeros(length, dtype=torch.int32, device=device)
    return buf
