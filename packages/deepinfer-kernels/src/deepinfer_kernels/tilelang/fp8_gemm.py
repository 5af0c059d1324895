"""TileLang FP8 GEMM for V4.1's block-scaled format on Hopper (sm_90a), prefill shapes.

out[M, N] = sum_k (a[m, k] * sa[m, k // 32]) * (b[n, k] * sb[n // 32, k // 32]), fp32 accumulation,
with a [M, K] e4m3, sa [M, K/32] fp32 powers of two, b [N, K] e4m3, sb [ceil(N/32), K/32] UE8M0.

Scheme (DeepGEMM's promotion, at V4.1's 32-wide scale granularity): the scales change every 32
along K, so one FP8 wgmma of depth 32 (one k-step of ``wgmma.m64nNk32``) accumulates a partial
product in fp32 registers with scale 1, and CUDA cores promote it into the running accumulator:
``acc += partial * (sa[m, kb] * sb[n // 32, kb])``. Promoting often also bounds the error of the
tensor core's reduced-precision FP8 accumulation to one 32-long sum.

Schedule (TileLang lowers it; see `lower_source`): K tiles of 128 (4 slices) arrive by TMA in a
`num_stages`-deep ring, together with the tile's scales (4 x block_m of sa, 4 x block_n/32 of sb),
loaded once per K tile. TileLang warp-specialises the loop: one producer warpgroup issues the
TMA loads, one consumer warpgroup per 64 rows of the tile runs the wgmma and the promotion. A K
tile is SLICES x n_split wgmmas (one per 32-slice and column chunk), each into its own partial
accumulator; `depth` of them are in flight (``wgmma.wait_group depth-1``) while the oldest is
promoted, the last depth-1 after a full wait (``wait_group 0``), after which the stage goes back to
the producer (the wait must come first: an issued wgmma still reads the stage). The two consumer
warpgroups run unsynchronised, so one's promotion also overlaps the other's wgmma.

Budget (per SM sub-partition and 128-deep K tile, 128x128 tile): each of its two consumer warps
runs 4 QGMMA (16 rows x 128 x 32 on this sub-partition's tensor core, 64 cycles each at the dense
FP8 rate) and promotes 4 x 64 accumulator values, one FFMA each (the sa*sb products are hoisted: 8
FMUL per slice and thread). So the tensor core needs 512 cycles per K tile and the promotion alone
512 issue slots, of the one instruction per cycle a sub-partition issues: at V4.1's 32-wide scale
granularity the CUDA-core promotion costs as many issue cycles as the wgmmas take (DeepGEMM's
128-wide blocks need a quarter of that). The compiled loop has 396 instructions per warp and K
tile (256 FFMA), i.e. 792 issue cycles against 512 tensor cycles: even at full issue the kernel
cannot exceed 512/792 of the FP8 peak (~1240 TFLOP/s at the 1.78 GHz Nsight Compute saw), and
1000 TFLOP/s would need 80% of all issue slots. Measured: ~590 TFLOP/s at 8K rows (53% issue;
NOTES.md has the stall reasons), 2.2x the Triton tiles.

The kernel's arithmetic for one row does not depend on M or on the other rows (fixed tiles; K
cut, if at all, by `TileConfig.k_split` from (N, K) only), so it is batch-invariant by
construction (checked bitwise by the GPU tests). With `invariant_config` it cuts K as the
TileLang decode kernel (`decode_gemm.py`) does and adds the chunks in the same order, so the rows
it gives at M > 64 are those that kernel gives at M <= 64 (`INVARIANT_PREFILL`, GPU-tested).

Routing (`supports`): on Hopper this tier takes M > 64 (in batch-invariant mode with
`INVARIANT_PREFILL`; `_route_reason`) where the cuda tier's faster kernel (`cuda/fp8_gemm.py`),
which the registry tries first, declines (no NVRTC, or a shape it refuses);
``DEEPINFER_KERNELS=fp8_gemm=tilelang`` (or ``fp8_linear=tilelang``) sends every call to it.
tilelang is imported only inside the functions that build or run a kernel; each (N, K, dtype,
config) compiles once per process (seconds).
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's argument annotations
# (tensor shapes built from closure variables) at definition time.

from dataclasses import dataclass
from typing import Any

import torch

from . import lowering

SCALE_BLOCK = 32  # V4.1's scale granularity along K (both operands) and along N (weights)
BLOCK_K = 128  # K per pipeline stage: 4 scale slices of 32
SLICES = BLOCK_K // SCALE_BLOCK
WARPGROUP_ROWS = 64  # rows of one wgmma (m64nNk32): one consumer warpgroup each
MAX_SHARED_BYTES = 227 * 1024  # opt-in dynamic shared memory per block on sm_90
MAX_ACC_REGS = 192  # fp32 fragment registers per consumer thread we allow (240 after setmaxnreg)
TMA_SMEM_ALIGN = 128  # bytes: a TMA load's shared-memory destination must be 128-B aligned
OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and schedule of one compiled kernel.

    block_m: rows per CTA (64 or 128; one consumer warpgroup per 64 rows).
    block_n: columns per CTA (multiple of 32, at most 256).
    n_split: wgmma column chunks per 32-slice (block_n / n_split columns each, a multiple of 32):
        the partial accumulator holds one chunk, so a wide tile fits the registers (128x256 with
        n_split=2: a 128-register accumulator and a 64-register partial per thread).
    num_stages: depth of the TMA ring of K tiles (each stage holds (block_m + block_n) x 128 B).
    depth: wgmma groups in flight per consumer warpgroup, each into its own partial accumulator
        (1 = issue, wait, promote; d > 1: the promotion of step t runs under the wgmmas of steps
        t+1 .. t+d-1). A k32 wgmma's latency is several times its issue cost, so depth hides it.
    sa_col_major: activation scales passed as [K/32, M] (padded to M % 4 == 0), so a tile's
        scales are 4 contiguous 4*block_m-byte rows instead of block_m 16-byte rows (fewer L2
        sectors per tile; the kernel is L2-bandwidth bound).
    swizzle_panel: CTA rasterisation panel (L2 reuse of A and B tiles), 0 = none.
    row_swizzle: lay the A and B tiles out as whole 128-B rows with the 128-B swizzle, each
        slice's wgmma reading at a 32-B offset inside the swizzle atom (as CUTLASS steps k), so
        the TMA moves a K tile as one box of 128-B rows instead of four of 32-B rows. TileLang
        infers a 32-B swizzle from each slice's K of 32 and merges a conflicting annotation down
        to it, so this option also overrides that inference while our kernel is lowered
        (`lowering.row_swizzle_lowering`). H200: 1-17% faster than 32-B slices at every measured
        prefill shape (NOTES.md), so it is the default.
    k_split: K cut into this many equal chunks (multiples of 128), each accumulated on its own
        and the chunks' sums added in ascending order into a running fp32 total, the order
        `triton.gemv.sum_splits` adds the decode kernel's chunk partials in. Batch-invariant mode
        uses the TileLang decode kernel's split (`invariant_config`), so a row computed here at
        M > 64 has the bits it has there at M <= 64. 1: one accumulator over all of K.
    early_scales: load each step's scales from shared memory into registers before its wgmma is
        issued, so the promotion after the wait does not stall on them (Nsight Compute had 32% of
        the stall cycles on those loads). H200, same run: 2-7% faster at every measured prefill
        shape (597 vs 584 TFLOP/s at 8192x5120x8192, 545 vs 509 at 8192x32768x1280), so it is
        the default. The arithmetic is the same either way.
    """

    block_m: int = 128
    block_n: int = 128
    n_split: int = 1
    num_stages: int = 4
    depth: int = 2
    sa_col_major: bool = True
    swizzle_panel: int = 8
    row_swizzle: bool = True
    k_split: int = 1
    early_scales: bool = True

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128):
            raise ValueError(f"TileConfig.block_m must be 64 or 128, got {self.block_m}")
        if self.block_n % SCALE_BLOCK or not 32 <= self.block_n <= 256:
            raise ValueError(
                f"TileConfig.block_n must be a multiple of 32 in [32, 256], got {self.block_n}"
            )
        if self.n_split < 1 or self.block_n % (self.n_split * SCALE_BLOCK):
            raise ValueError(
                f"TileConfig.n_split must divide block_n={self.block_n} into multiples of 32, "
                f"got {self.n_split}"
            )
        if not 1 <= self.depth <= SLICES * self.n_split:
            raise ValueError(
                f"TileConfig.depth must be in [1, {SLICES * self.n_split}] (wgmmas per K tile), "
                f"got {self.depth}"
            )
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"TileConfig.num_stages must be in [1, 8], got {self.num_stages}")
        if self.k_split < 1:
            raise ValueError(f"TileConfig.k_split must be >= 1, got {self.k_split}")
        if self.swizzle_panel < 0:
            raise ValueError(f"TileConfig.swizzle_panel must be >= 0, got {self.swizzle_panel}")
        if self.fragment_registers > MAX_ACC_REGS:
            raise ValueError(
                f"TileConfig: block_n={self.block_n}, n_split={self.n_split}, "
                f"depth={self.depth} needs {self.fragment_registers} fp32 fragment registers "
                f"per thread (limit {MAX_ACC_REGS}); raise n_split or lower depth"
            )
        if self.shared_bytes > MAX_SHARED_BYTES:
            raise ValueError(
                f"TileConfig: {self.shared_bytes} B of shared memory exceeds {MAX_SHARED_BYTES}; "
                "lower num_stages or the tile"
            )

    @property
    def threads(self) -> int:
        """Consumer threads (TileLang adds one producer warpgroup of 128 on top)."""
        return self.block_m // WARPGROUP_ROWS * 128

    @property
    def chunk_n(self) -> int:
        """Columns of one wgmma (and of the partial accumulator)."""
        return self.block_n // self.n_split

    @property
    def fragment_registers(self) -> int:
        """fp32 registers per consumer thread for the accumulator, the K-chunk total (with
        k_split > 1) and the partial(s)."""
        acc = WARPGROUP_ROWS * self.block_n // 128
        partial = WARPGROUP_ROWS * self.chunk_n // 128
        return acc * (2 if self.k_split > 1 else 1) + partial * self.depth

    @property
    def shared_bytes(self) -> int:
        """Pipeline ring (operands + scales); the bf16/fp32 epilogue tile reuses the ring."""
        operands = (self.block_m + self.block_n) * BLOCK_K  # e4m3: one byte each
        scales = (self.block_m + self.sb_tile_rows) * SLICES * 4
        return self.num_stages * (operands + scales)

    @property
    def sb_tile_rows(self) -> int:
        """Rows of weight scales loaded per stage: the tile's block_n/32, rounded up so that one
        stage is a multiple of 128 B (each stage is a TMA destination; the extra rows belong to
        the next N tile, or are TMA's zero fill past the end, and are never read)."""
        rows_per_align = TMA_SMEM_ALIGN // (SLICES * 4)
        return -(-(self.block_n // SCALE_BLOCK) // rows_per_align) * rows_per_align


# 128x128, column-major activation scales, 128-B rows, early scales: best or within 5% of the best
# variant at every measured M (128 .. 16384) on the H200 (NOTES.md); 128x256 loses 2x at M=128.
DEFAULT_CONFIG = TileConfig()


# -- host-side logic (pure torch; CPU-testable) ----------------------------------------------------


def shape_reason(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> str | None:
    """Why the kernel cannot take these operands (shape/dtype limits), or None.

    K must be a multiple of 128 (whole K tiles; TMA strides of the scale rows are 16-B aligned).
    """
    if x_fp8.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        return "x_fp8 and w must be float8_e4m3fn"
    if x_scale.dtype != torch.float32:
        return f"x_scale must be float32, got {x_scale.dtype}"
    if w_scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        return f"w_scale must be float8_e8m0fnu or float32, got {w_scale.dtype}"
    if x_fp8.dim() != 2 or w.dim() != 2 or w.shape[1] != x_fp8.shape[1]:
        return f"x_fp8 [M, K] and w [N, K] must share K, got {list(x_fp8.shape)}, {list(w.shape)}"
    m, k = x_fp8.shape
    if k % BLOCK_K:
        return f"K must be a multiple of {BLOCK_K}, got {k}"
    if list(x_scale.shape) != [m, k // SCALE_BLOCK]:
        return f"x_scale must be [{m}, {k // SCALE_BLOCK}], got {list(x_scale.shape)}"
    return None


def weight_scale_fp32(w_scale: torch.Tensor, n: int) -> torch.Tensor:
    """w_scale [ceil(N/32), K/32] e8m0 (or fp32) -> the same values as fp32 (exact: powers of two).

    The kernel loads a whole N tile of scales by TMA; rows past ceil(N/32) come back as zeros
    (TMA's out-of-bounds fill) and scale only B rows that are zero-filled too, in output columns
    the store clips, so no padding is needed.
    """
    rows = -(-n // SCALE_BLOCK)
    if w_scale.dim() != 2 or w_scale.shape[0] != rows:
        raise ValueError(f"w_scale must be [{rows}, K/32] for N={n}, got {list(w_scale.shape)}")
    return w_scale.to(torch.float32)


def activation_scales(x_scale: torch.Tensor, col_major: bool) -> torch.Tensor:
    """x_scale [M, K/32] fp32 as the kernel takes it: itself (TMA-ready) or, with `col_major`,
    transposed to [K/32, M4] with M4 = M rounded up to 4 (TMA needs 16-B row strides; the pad
    columns are zeros and scale only rows the kernel never stores)."""
    if not col_major:
        return tma_ready(x_scale)
    m, kb = x_scale.shape
    out = torch.zeros(kb, -(-m // 4) * 4, dtype=torch.float32, device=x_scale.device)
    out[:, :m] = x_scale.t()
    return out


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` if it is contiguous and 16-byte aligned (TMA's requirement on the base address), else a
    contiguous copy (fresh allocations are aligned)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def promote_reference(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    sb: torch.Tensor,
    cfg: TileConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """The kernel's arithmetic in torch (fp32), tile by tile: for every N tile and 32-slice, the
    unscaled partial a[:, slice] @ b[tile, slice]^T, then acc += partial * sa[:, kb] * sb[row, kb]
    with sb's row = tile * block_n/32 + j // 32, rows past the end read as 0 (TMA's fill); with
    `cfg.k_split` chunks, each chunk's acc starts at 0 and the chunk sums are added in order.

    Shapes as `fp8_gemm`, sb from `weight_scale_fp32`; returns [M, N] fp32. Used to check
    the host-side layout logic on CPU; the GPU test compares the kernel with `ref`.
    """
    m, k = x_fp8.shape
    n = w.shape[0]
    a = x_fp8.to(torch.float32)
    b = w.to(torch.float32)
    out = torch.zeros(m, n, dtype=torch.float32, device=x_fp8.device)
    blocks_per_tile = cfg.block_n // SCALE_BLOCK
    chunk_blocks = k // SCALE_BLOCK // cfg.k_split
    for tile in range(-(-n // cfg.block_n)):
        cols = slice(tile * cfg.block_n, min(n, (tile + 1) * cfg.block_n))
        width = cols.stop - cols.start
        sb_tile = torch.zeros(blocks_per_tile, sb.shape[1], dtype=sb.dtype, device=sb.device)
        tile_rows = sb[tile * blocks_per_tile : (tile + 1) * blocks_per_tile]
        sb_tile[: tile_rows.shape[0]] = tile_rows  # [bn/32, K/32], zero-filled past the end
        col_block = torch.arange(width, device=x_fp8.device) // SCALE_BLOCK
        for chunk in range(cfg.k_split):
            acc = torch.zeros(m, width, dtype=torch.float32, device=x_fp8.device)
            for kb in range(chunk * chunk_blocks, (chunk + 1) * chunk_blocks):
                ks = slice(kb * SCALE_BLOCK, (kb + 1) * SCALE_BLOCK)
                partial = a[:, ks] @ b[cols, ks].t()
                acc += partial * (x_scale[:, kb : kb + 1] * sb_tile[col_block, kb][None, :])
            out[:, cols] = acc if chunk == 0 else out[:, cols] + acc
    return out


INVARIANT_PREFILL = True
"""Batch-invariant mode sends M > 64 here with `invariant_config`, instead of running the TileLang
decode kernel at every M: H200, same run, 8192x5120x8192 in 1.234 ms (557 TFLOP/s) against the
default's 1.113 (618) here and ~2.5 ms on the decode kernel. The GPU test
`test_invariant_rows_match_the_decode_kernel` shows the two kernels' rows bitwise equal. (UE8M0
weight-scale bytes 0 and 255, which quantisation never produces, decode differently in the two
kernels: 2**-127 / NaN here through torch, 0 / inf from the byte in the decode kernel.)"""


def invariant_config(n: int, k: int) -> TileConfig:
    """The tile configuration batch-invariant mode runs an [N, K] weight with: the TileLang decode
    kernel's K split (`decode_gemm.decode_tile_split`), so rows at M > 64 (here) and M <= 64
    (there) get the same bits. A split needs a running total beside the accumulator, so the
    columns go in two 64-wide wgmma chunks to stay within the register budget. H200, same run:
    +8..11% over the default at M = 128..16384 (1.234 vs 1.113 ms at 8192x5120x8192)."""
    from .decode_gemm import decode_tile_split

    split = decode_tile_split(n, k)
    if split == 1:
        return DEFAULT_CONFIG
    return TileConfig(n_split=2, k_split=split)


def route_reason(
    device_type: str,
    capability: tuple[int, int] | None,
    *,
    selected: bool,
    batch_invariant: bool,
    rows: int,
    decode_max_m: int,
    invariant_decode_tilelang: bool,
) -> str | None:
    """Why the registry should not pick this tier (device, mode, M), or None.

    Open on Hopper for M > decode_max_m (the prefill GEMMs; below that the weight-streaming
    decode kernels that triton/linear.py routes to are faster; the registry tries the cuda
    tier's kernel first). In
    batch-invariant mode too, when the decode path runs the TileLang decode kernel there
    (`invariant_decode_tilelang`): this kernel then cuts K as that one does
    (`invariant_config`), so a row's bits do not depend on M; otherwise the Triton tiles, whose
    K split matches the Triton decode kernel, keep the rows equal. Selected explicitly
    (`selected`: ``DEEPINFER_KERNELS=<op>=tilelang``) it takes every M: one kernel for every M is
    invariant by construction.
    """
    if device_type != "cuda":
        return f"input on {device_type}"
    if capability != (9, 0):
        return "needs sm_90a (Hopper wgmma)"
    if selected:
        return None
    if rows <= decode_max_m:
        return f"M={rows} <= {decode_max_m}: the decode kernels (triton/linear.py) are faster"
    if batch_invariant and not invariant_decode_tilelang:
        return (
            "batch-invariant mode with the Triton decode kernel: the Triton tiles cut K as it does"
        )
    return None


def _route_reason(op: str, x: torch.Tensor, rows: int, batch_invariant: bool) -> str | None:
    """`route_reason` for a call of `op` on x (reads the registry's override and the device)."""
    from ..registry import REGISTRY, device_capability

    if x.device.type != "cuda":
        return f"input on {x.device.type}"
    from ..triton.linear import DECODE_MAX_M, TILELANG_INVARIANT

    return route_reason(
        "cuda",
        device_capability(x.device),
        selected=REGISTRY.settings.overrides.get(op) == "tilelang",
        batch_invariant=batch_invariant,
        rows=rows,
        decode_max_m=DECODE_MAX_M,
        invariant_decode_tilelang=INVARIANT_PREFILL and TILELANG_INVARIANT,
    )


def supports(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    batch_invariant: bool = False,
    **_: Any,
) -> str | None:
    """Registry check for `fp8_gemm`: why the tilelang tier should not run this call, or None."""
    why = _route_reason("fp8_gemm", x_fp8, x_fp8.shape[0], batch_invariant)
    if why is not None:
        return why
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype must be one of {list(OUT_DTYPES)}, got {out_dtype}"
    return shape_reason(x_fp8, x_scale, w, w_scale)


def supports_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    batch_invariant: bool = False,
    **_: Any,
) -> str | None:
    """Registry check for `fp8_linear` (x [..., K] float): as `supports`, on the quantised x."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    why = _route_reason("fp8_linear", x, rows, batch_invariant)
    if why is not None:
        return why
    if x.dtype not in OUT_DTYPES:
        return f"x must be one of {list(OUT_DTYPES)}, got {x.dtype}"
    if x.shape[-1] % BLOCK_K:
        return f"K must be a multiple of {BLOCK_K}, got {x.shape[-1]}"
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2 or w.shape[1] != x.shape[-1]:
        return f"w must be float8_e4m3fn [N, {x.shape[-1]}], got {w.dtype} {list(w.shape)}"
    return None


# -- the kernel (tilelang imported here only) ----------------------------------------------


def build_kernel(n: int, k: int, out_dtype: str = "bfloat16", cfg: TileConfig = DEFAULT_CONFIG):
    """The TileLang prim_func for weight [n, k] (M dynamic).

    Arguments of the kernel: A [M, K] e4m3, SA [M, K/32] fp32 (or [K/32, M4] with
    `cfg.sa_col_major`, M4 = M rounded up to 4: `activation_scales`), B [N, K] e4m3,
    SB [ceil(N/32), K/32] fp32 (`weight_scale_fp32`), C [M, N] out_dtype.
    """
    import tilelang.language as T

    if k % (cfg.k_split * BLOCK_K):
        raise ValueError(
            f"build_kernel: k={k} must cut into k_split={cfg.k_split} chunks of {BLOCK_K}s"
        )
    if out_dtype not in OUT_DTYPES.values():
        raise ValueError(f"build_kernel: out_dtype must be one of {list(OUT_DTYPES.values())}")
    bm, bn, bk, cn = cfg.block_m, cfg.block_n, BLOCK_K, cfg.chunk_n
    bn_blocks = bn // SCALE_BLOCK
    kb_total = k // SCALE_BLOCK
    sb_rows = -(-n // SCALE_BLOCK)
    m = T.dynamic("m")
    m4 = T.dynamic("m4")  # rows of the column-major activation scales (M rounded up to 4)
    sa_shape = (kb_total, m4) if cfg.sa_col_major else (m, kb_total)
    sa_tile_shape = (SLICES, bm) if cfg.sa_col_major else (bm, SLICES)
    fp8 = "float8_e4m3fn"
    policy = T.GemmWarpPolicy.FullRow  # each consumer warpgroup: 64 rows x the whole chunk
    # one wgmma per (32-slice, column chunk), in issue order; a Python tuple, so the builder
    # unrolls every loop over it
    steps = tuple((s, h) for s in range(SLICES) for h in range(cfg.n_split))
    frag_regs = WARPGROUP_ROWS * cn // 128  # fp32 registers per thread of one partial
    chunk_tiles = k // bk // cfg.k_split  # K tiles per K chunk

    def sa_at(sa_tile, i, s):
        return sa_tile[s, i] if cfg.sa_col_major else sa_tile[i, s]

    @T.macro
    def issue(a_tile, b_tile, part, s, h):
        """part = a[:, slice s] @ b[chunk h, slice s]^T (an m64 x cn x k32 wgmma per warpgroup)."""
        T.wgmma_gemm(
            a_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
            b_tile[h * cn : (h + 1) * cn, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
            part, transpose_B=True, clear_accum=True, policy=policy,
        )  # fmt: skip

    @T.macro
    def promote(acc, part, sa_tile, sb_tile, s, h):
        """acc[chunk h] += part * sa[row, s] * sb[col // 32, s] on CUDA cores (one FFMA each)."""
        for i, j in T.Parallel(bm, cn):
            acc[i, j] += part[i, j] * (sa_at(sa_tile, i, s) * sb_tile[(h * cn + j) // 32, s])

    @T.macro
    def load_scales(sa_reg, sb_reg, sa_tile, sb_tile, s, h):
        """The scales step (s, h) will promote with, into registers (issued before the wait)."""
        for i in T.Parallel(bm):
            sa_reg[i] = sa_at(sa_tile, i, s)
        for c in T.unroll(cn // SCALE_BLOCK):
            sb_reg[c] = sb_tile[h * cn // SCALE_BLOCK + c, s]

    @T.macro
    def promote_from(acc, part, sa_reg, sb_reg):
        """`promote` with the scales already in registers, one 32-column block at a time."""
        for c in tuple(range(cn // SCALE_BLOCK)):
            for i, j in T.Parallel(bm, SCALE_BLOCK):
                col = c * SCALE_BLOCK + j
                acc[i, col] += part[i, col] * (sa_reg[i] * sb_reg[c])

    def regs(bufs, slot):
        """Slot `slot` of the early-scale registers, or None without early_scales."""
        return bufs[slot] if bufs else None

    @T.macro
    def promote_step(acc, part, sa_reg, sb_reg, sa_tile, sb_tile, s, h):
        """Promote step (s, h): scales from registers (`early_scales`) or from shared memory."""
        if cfg.early_scales:
            promote_from(acc, part, sa_reg, sb_reg)
        else:
            promote(acc, part, sa_tile, sb_tile, s, h)

    @T.macro
    def fold(total, acc, first):
        """End of a K chunk but the last: total = acc (the first chunk) or total + acc, then
        acc = 0."""
        for i, j in T.Parallel(bm, cn):
            total[i, j] = T.if_then_else(first, acc[i, j], total[i, j] + acc[i, j])
        T.clear(acc)

    @T.macro
    def add_total(total, acc):
        """After the last chunk: acc = total + acc, the last of the ascending chunk sums."""
        for i, j in T.Parallel(bm, cn):
            acc[i, j] = total[i, j] + acc[i, j]

    @T.prim_func
    def fp8_gemm_kernel(
        A: T.Tensor((m, k), fp8),
        SA: T.Tensor(sa_shape, "float32"),
        B: T.Tensor((n, k), fp8),
        SB: T.Tensor((sb_rows, kb_total), "float32"),
        C: T.Tensor((m, n), out_dtype),
    ):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=cfg.threads) as (bx, by):
            a_tile = T.alloc_shared((bm, bk), fp8)
            b_tile = T.alloc_shared((bn, bk), fp8)
            sa_tile = T.alloc_shared(sa_tile_shape, "float32")
            sb_tile = T.alloc_shared((cfg.sb_tile_rows, SLICES), "float32")
            c_tile = T.alloc_shared((bm, bn), out_dtype)
            accs = tuple(T.alloc_fragment((bm, cn), "float32") for _ in range(cfg.n_split))
            parts = tuple(T.alloc_fragment((bm, cn), "float32") for _ in range(cfg.depth))
            chunked = cfg.k_split > 1
            # with early_scales, each wgmma in flight has its slice's scales in registers
            n_regs = cfg.depth if cfg.early_scales else 0
            sa_regs = tuple(T.alloc_fragment((bm,), "float32") for _ in range(n_regs))
            sb_regs = tuple(T.alloc_local((cn // SCALE_BLOCK,), "float32") for _ in range(n_regs))
            # the running total of the K chunks, one fragment per accumulator chunk (a total in
            # shared memory was slower on the H200: TileLang fences every K tile around it)
            totals = tuple(
                T.alloc_fragment((bm, cn), "float32") for _ in range(cfg.n_split if chunked else 0)
            )

            if cfg.row_swizzle:
                from tilelang.layout import make_full_bank_swizzled_layout as row_swizzled

                T.annotate_layout({a_tile: row_swizzled(a_tile), b_tile: row_swizzled(b_tile)})
            if cfg.swizzle_panel:
                T.use_swizzle(panel_size=cfg.swizzle_panel)
            for acc in accs + totals:  # (a total is first written, not added to, at chunk 0;
                T.clear(acc)  # cleared so that TileLang's read-before-write check is quiet)
            for kt in T.Pipelined(k // bk, num_stages=cfg.num_stages):
                T.copy(A[by * bm, kt * bk], a_tile)
                T.copy(B[bx * bn, kt * bk], b_tile)
                if cfg.sa_col_major:
                    T.copy(SA[kt * SLICES, by * bm], sa_tile)
                else:
                    T.copy(SA[by * bm, kt * SLICES], sa_tile)
                T.copy(SB[bx * bn_blocks, kt * SLICES], sb_tile)
                d = cfg.depth
                if d == 1:  # T.gemm issues the wgmma and waits for it
                    for s, h in steps:
                        if cfg.early_scales:
                            load_scales(sa_regs[0], sb_regs[0], sa_tile, sb_tile, s, h)
                        T.gemm(
                            a_tile[:, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
                            b_tile[h * cn : (h + 1) * cn, s * SCALE_BLOCK : (s + 1) * SCALE_BLOCK],
                            parts[0], transpose_B=True, clear_accum=True, policy=policy,
                        )  # fmt: skip
                        promote_step(
                            accs[h], parts[0], regs(sa_regs, 0), regs(sb_regs, 0), sa_tile,
                            sb_tile, s, h,
                        )  # fmt: skip
                else:
                    # issue step t into partial t % d; once d groups are in flight, wait until
                    # the oldest is done and promote it under the others
                    for t in tuple(range(len(steps))):
                        if cfg.early_scales:
                            load_scales(sa_regs[t % d], sb_regs[t % d], sa_tile, sb_tile, *steps[t])
                        issue(a_tile, b_tile, parts[t % d], *steps[t])
                        if t >= d - 1:
                            T.wait_wgmma(d - 1)
                            old = t - d + 1
                            T.warpgroup_fence_operand(parts[old % d], num_regs=frag_regs)
                            slot = old % d
                            promote_step(
                                accs[steps[old][1]], parts[slot], regs(sa_regs, slot),
                                regs(sb_regs, slot), sa_tile, sb_tile, *steps[old],
                            )  # fmt: skip
                    T.wait_wgmma(0)
                    # TileLang hands a stage back to the producer right after the last statement
                    # that touches its buffers, and an issued wgmma still reads them: these two
                    # (empty) uses put the hand-back after the wait for every wgmma of the tile.
                    T.evaluate(T.address_of(a_tile[0, 0]))
                    T.evaluate(T.address_of(b_tile[0, 0]))
                    for old in tuple(range(len(steps) - d + 1, len(steps))):
                        T.warpgroup_fence_operand(parts[old % d], num_regs=frag_regs)
                        slot = old % d
                        promote_step(
                            accs[steps[old][1]], parts[slot], regs(sa_regs, slot),
                            regs(sb_regs, slot), sa_tile, sb_tile, *steps[old],
                        )  # fmt: skip
                if chunked:  # noqa: SIM102 (a Python flag, then one TIR condition)
                    if (kt + 1) % chunk_tiles == 0 and kt + 1 < k // bk:
                        for h in tuple(range(cfg.n_split)):
                            fold(totals[h], accs[h], kt + 1 == chunk_tiles)
            for h in tuple(range(cfg.n_split)):
                if chunked:
                    add_total(totals[h], accs[h])
                T.copy(accs[h], c_tile[:, h * cn : (h + 1) * cn])
            T.copy(c_tile, C[by * bm, bx * bn])

    return fp8_gemm_kernel


def lower_source(
    n: int, k: int, out_dtype: str = "bfloat16", cfg: TileConfig = DEFAULT_CONFIG
) -> str:
    """CUDA source of the kernel for sm_90a, lowered without nvcc (for inspection and CPU tests)."""
    return lowering.lower_source(build_kernel(n, k, out_dtype, cfg), cfg.row_swizzle)


# one kernel per (N, K, out dtype, config): M is a dynamic argument of the kernel
_KERNELS = lowering.KernelCache("TileLang FP8 GEMM", build_kernel)


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    batch_invariant: bool = False,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """x_fp8 [M, K] e4m3 with x_scale [M, K/32] fp32 powers of two, w [N, K] e4m3 with w_scale
    [ceil(N/32), K/32] e8m0 (or fp32) -> [M, N] out_dtype, fp32 accumulation.

    Every configuration is batch-invariant (the tiles do not depend on M); `batch_invariant`
    picks `invariant_config` (the decode kernel's K split), unless `config` is given.
    """
    why = shape_reason(x_fp8, x_scale, w, w_scale)
    if why is not None:
        raise ValueError(f"tilelang fp8_gemm: {why}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {list(OUT_DTYPES)}, got {out_dtype}")
    m, k = x_fp8.shape
    n = w.shape[0]
    cfg = config or (invariant_config(n, k) if batch_invariant else DEFAULT_CONFIG)
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if m == 0 or n == 0:
        return out
    sb = tma_ready(weight_scale_fp32(w_scale, n))
    kernel = _KERNELS.get((n, k, OUT_DTYPES[out_dtype], cfg), cfg.row_swizzle)
    sa = activation_scales(x_scale, cfg.sa_col_major)
    kernel(tma_ready(x_fp8), sa, tma_ready(w), sb, out)
    return out


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    batch_invariant: bool = False,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """x [..., K] float -> [..., N] x.dtype: per-32 FP8 activation quantisation, then `fp8_gemm`
    on w [N, K] e4m3 / w_scale [ceil(N/32), K/32] (`triton.quant.quantised_linear`)."""
    from ..triton.quant import quantised_linear

    kw = dict(batch_invariant=batch_invariant, config=config)
    return quantised_linear(fp8_gemm, x, w, w_scale, **kw)
