"""FP8 block-scaled prefill GEMM in CUDA C++ (`prefill_gemm.cu`): FP8 wgmma per 32-deep K
slice, each slice's partial promoted into fp32 accumulators with its activation and weight
scales by the CUDA cores; the TMA feeds a ring of 128-deep K stages; one producer warpgroup, two
consumer warpgroups of 64 rows; the tile leaves through shared memory by TMA stores. Same
contract as `ref.linear.fp8_gemm`: only the fp32 summation order differs (and the tensor core's
own sum of each 32 products).

A call's time goes by waves of tiles: `call_config` picks the tile width and whether to cut the
last partial wave's tiles along K (`tail_split`) or to walk the tiles with one persistent CTA per
SM (`persistent`) by a call-time model fitted on the H200 (`tools/bench_prefill.py`). In
batch-invariant mode K is cut as the decode kernel cuts it (`invariant_config`), so a row has
the decode kernel's bits at every M. Which calls run here is decided in `ops/linear.py`.

Compiled by NVRTC at first use (once per process per config; no GPU needed to compile).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import module
from .decode_gemm import k_split
from .module import MAX_SHARED, check_fields

SOURCE = Path(__file__).with_name("prefill_gemm.cu")
ARCH = "sm_90a"
BLOCK_M = 128  # rows per CTA: two consumer warpgroups of 64
BLOCK_K = 128  # K values per ring stage (one 128-byte swizzle row of e4m3)
THREADS = 384  # a producer warpgroup and two consumer warpgroups
DYNAMIC_SHARED = MAX_SHARED - 2048  # the stage barriers are static (about 1 KiB with padding)


MAX_TAIL_SPLIT = 8
"""The most pieces a tile of the last partial wave is cut into (`Fp8GemmCudaConfig.tail_split`)."""


@dataclass(frozen=True)
class Fp8GemmCudaConfig:
    """block_n: output columns per CTA (64 or 128: the wgmma's N; 192 would spill the two
    partials); stages: 128-deep K stages in the TMA ring (2..8, as shared memory allows; see
    `config_for`); group_m: m tiles that consecutive CTAs walk down before the next column of
    tiles (1..64), so that a wave's weight tiles stay in L2. None of these changes a sum.
    k_split: K cut into this many equal chunks (1..16; multiples of 128), each summed from zero,
    the chunk sums added in order, their running total in shared memory (`invariant_config`).
    persistent: one CTA per SM walks the tiles (the producer loads the next tile while the
    consumers store this one, from a staging of their own: fewer stages fit). tail_split: the
    tiles of the last partial wave (tiles % SMs) cut along K into this many pieces (1..8, at most
    one per stage), which the last piece to finish adds in piece order (`call_config`). With a
    K split the pieces must be whole chunks (tail_split divides k_split; a piece after the first
    keeps its chunks' sums apart): a cut tile then has the uncut tile's bits; without one a cut
    row's bits depend on M (auto mode only)."""

    block_n: int = 128
    stages: int = 6
    group_m: int = 16
    k_split: int = 1
    persistent: bool = False
    tail_split: int = 1

    def __post_init__(self) -> None:
        checks = (
            ("block_n", self.block_n in (64, 128), "64 or 128"),
            ("stages", 2 <= self.stages <= 8, "2..8"),
            ("group_m", 1 <= self.group_m <= 64, "1..64"),
            ("k_split", 1 <= self.k_split <= 16, "1..16"),
            ("persistent", isinstance(self.persistent, bool), "a bool"),
            ("tail_split", 1 <= self.tail_split <= MAX_TAIL_SPLIT, f"1..{MAX_TAIL_SPLIT}"),
        )
        check_fields(self, checks)
        if self.tail_split > 1 and self.persistent:
            raise ValueError("Fp8GemmCudaConfig.tail_split > 1 needs persistent False")
        if self.tail_split > 1 and self.k_split > 1 and self.k_split % self.tail_split:
            raise ValueError(
                f"Fp8GemmCudaConfig.tail_split {self.tail_split} with k_split {self.k_split}: the "
                "pieces of a cut tile must be whole chunks of the K split (tail_split divides it)"
            )


DEFAULT = Fp8GemmCudaConfig()
"""The measured-fastest uncut config at 2K-16K rows (PERF.md)."""


def shared_bytes(k: int, cfg: Fp8GemmCudaConfig) -> int:
    """Dynamic shared memory of a call with reduction length k: the ring (a 128 x 128 bytes, b
    block_n x 128 bytes, sa 128 x 16 bytes per stage), with a K split the chunks' fp32 total of
    the tile, the weight scales of the tile's columns over all of K as floats (rows of a
    multiple of 4), persistent the tile's staging for its stores (room for fp32 sums, on 1024
    bytes), and 1 KiB to align the ring on 1024."""
    stage = BLOCK_M * BLOCK_K + cfg.block_n * BLOCK_K + BLOCK_M * 16
    total = BLOCK_M * cfg.block_n * 4 if cfg.k_split > 1 else 0
    sb_stride = (cfg.block_n // 32 + 3) // 4 * 4
    staging = BLOCK_M * cfg.block_n * 4 + 1024 if cfg.persistent else 0  # fp32 sums, aligned
    return cfg.stages * stage + total + (k // 32) * sb_stride * 4 + staging + 1024


def config_for(k: int, base: Fp8GemmCudaConfig = DEFAULT) -> Fp8GemmCudaConfig:
    """base with as many of its stages as shared memory holds at reduction length k (the sb
    table grows with K; at least 2 stages)."""
    cfg = base
    while cfg.stages > 2 and shared_bytes(k, cfg) > DYNAMIC_SHARED:
        cfg = replace(cfg, stages=cfg.stages - 1)
    return cfg


@functools.lru_cache(maxsize=4096)  # pure; called on every routed call
def shape_reason(n: int, k: int, cfg: Fp8GemmCudaConfig | None = None) -> str | None:
    """Why the kernel cannot take w [N, K] with this config, or None: K a multiple of 128 (whole
    ring stages; sa rows of 16-byte multiples for the TMA), N a multiple of 8 (paired column
    stores), the shared memory within the SM's."""
    if k % BLOCK_K or k <= 0:
        return f"K={k} must be a positive multiple of {BLOCK_K}"
    if cfg is not None and k % (cfg.k_split * BLOCK_K):
        return f"K={k} does not cut into k_split={cfg.k_split} chunks of {BLOCK_K}s"
    if n % 8 or n <= 0:
        return f"N={n} must be a positive multiple of 8"
    cfg = cfg or config_for(k)
    need = shared_bytes(k, cfg)
    if need > DYNAMIC_SHARED:
        return (
            f"{need} bytes of shared memory at K={k} (stages={cfg.stages}), over {DYNAMIC_SHARED}"
        )
    return None


def call_reason(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: Fp8GemmCudaConfig | None = None,
) -> str | None:
    """Why `fp8_gemm` cannot run this call here (`operand_reason`, the shape limits, device,
    NVRTC), or None."""
    why = module.operand_reason(x_fp8, x_scale, w, w_scale, out_dtype)
    return why or shape_reason(w.shape[0], w.shape[1], cfg) or module.launch_reason(x_fp8)


@functools.lru_cache(maxsize=4096)  # pure; called on every routed call
def invariant_config(n: int, k: int) -> Fp8GemmCudaConfig:
    """The config batch-invariant mode runs an [N, K] weight with: the decode kernel's K split
    (`decode_gemm.k_split`), as many stages as then fit."""
    return config_for(k, replace(DEFAULT, k_split=k_split(n, k)))


# The call-time model `call_config` picks tiles by, fitted to V4.1's five prefill weights at
# M = 256-8192 on the H200 (`tools/bench_prefill.py`, every config at each point; PERF.md).
N64_TILE_TIME = 0.64
"""A 128 x 64 tile's time over a 128 x 128 tile's."""
TILE_FIXED_STAGES = 6
"""A tile's time beyond its K stages (the prologue, the ring's first loads, the stores), in the
time of one 128-deep stage."""
CUT_FIXED_STAGES = 14
"""A cut tile's time beyond its piece's share and a tile's fixed time, in stages: the pieces'
sums out to L2 and back, and the wait for the last piece."""
CUT_SLOWDOWN = 0.02
"""The kernel built with the tail cut runs its whole tiles this much slower: ptxas schedules the
same K loop otherwise."""
CUT_MAX_WAVES = 4
"""No cut past this many whole waves: the SMs then no longer finish a wave together, and the
last partial wave costs less than a wave."""
MIN_PIECE_STAGES = 4
"""The fewest 128-deep K stages a piece of a cut tile takes."""
PERSISTENT_SAVED_STAGES = 1.0
"""A persistent CTA's tiles after its first take this many stages less than a tile of its own:
their stores overlap the next tile's first loads."""


def tail_split_for(tiles: int, k: int, sms: int, chunks: int | None = None) -> int:
    """Pieces per tile of the last partial wave (`Fp8GemmCudaConfig.tail_split`): as many as the
    SMs that wave leaves idle take, up to `MAX_TAIL_SPLIT` and one per `MIN_PIECE_STAGES` stages of
    K; 1 (no cut) when every wave is whole or more than `CUT_MAX_WAVES` are. chunks: the count of
    a K split's chunks (batch-invariant mode), whose whole chunks the pieces must take: the most
    pieces that divide it and fit, else 1."""
    waves, tail = divmod(tiles, sms)
    if tail == 0 or waves > CUT_MAX_WAVES:
        return 1
    most = min(sms // tail, MAX_TAIL_SPLIT, k // BLOCK_K // MIN_PIECE_STAGES)
    if chunks is not None:
        return max((d for d in range(1, min(chunks, most) + 1) if chunks % d == 0), default=1)
    return max(1, most)


def tiles_of(m: int, n: int, block_n: int) -> int:
    """Output tiles of M rows on N columns: 128 rows by block_n columns."""
    return -(-m // BLOCK_M) * -(-n // block_n)


def call_time(
    m: int, n: int, k: int, block_n: int, tail_split: int, sms: int, persistent: bool = False
) -> float:
    """The modelled time of a call in 128-deep stages of a 128 x 128 tile: one CTA per SM, so the
    whole waves of tiles, then the last partial wave whole or cut along K into tail_split pieces
    per tile; persistent (uncut), each CTA's tiles after its first `PERSISTENT_SAVED_STAGES`
    shorter."""
    steps = k // BLOCK_K
    width = N64_TILE_TIME if block_n == 64 else 1.0
    waves, tail = divmod(tiles_of(m, n, block_n), sms)
    tile = steps + TILE_FIXED_STAGES
    if tail and tail_split > 1:
        piece = -(-steps // tail_split) + TILE_FIXED_STAGES + CUT_FIXED_STAGES
        return width * (waves * tile * (1 + CUT_SLOWDOWN) + piece)
    whole = waves + (tail > 0)
    saved = PERSISTENT_SAVED_STAGES * (whole - 1) if persistent else 0.0
    return width * (whole * tile - saved)


@functools.lru_cache(maxsize=4096)  # pure; called on every routed call
def call_config(m: int, n: int, k: int, batch_invariant: bool, sms: int = 132) -> Fp8GemmCudaConfig:
    """The config a call of M rows on an [N, K] weight without one runs on `sms` SMs: the tile
    width (64 or 128 columns), and whether to cut the tail into `tail_split_for`'s pieces or run
    persistent CTAs, of the least `call_time` (on a tie the wider, uncut, one CTA per tile); in
    batch-invariant mode `invariant_config`'s K split (not for a K the split cannot cut:
    `shape_reason` refuses those), whose chunks are then the pieces of a cut (a row's bits stay
    those of the uncut tiles at every M); as many stages as fit. None of these changes a sum."""
    base = invariant_config(n, k) if batch_invariant and k % BLOCK_K == 0 else DEFAULT
    chunks = base.k_split if batch_invariant else None
    choices = [(128, 1, False), (64, 1, False)]
    choices += [(bn, tail_split_for(tiles_of(m, n, bn), k, sms, chunks), False) for bn in (128, 64)]
    for block_n in (128, 64):  # persistent where its staging leaves room for 2 stages
        walker = config_for(k, replace(base, block_n=block_n, persistent=True))
        if shared_bytes(k, walker) <= DYNAMIC_SHARED:
            choices.append((block_n, 1, True))
    block_n, split, persistent = min(choices, key=lambda c: call_time(m, n, k, *c[:2], sms, c[2]))
    return config_for(k, replace(base, block_n=block_n, tail_split=split, persistent=persistent))


def defines(cfg: Fp8GemmCudaConfig, sb_f32: bool, out_f32: bool) -> dict[str, int]:
    """The kernel's compile-time constants (the tail's piece count is a launch argument)."""
    return dict(
        BLOCK_N=cfg.block_n, STAGES=cfg.stages, GROUP_M=cfg.group_m,
        K_SPLIT=int(cfg.k_split > 1), PERSISTENT=int(cfg.persistent),
        SPLIT_TAIL=int(cfg.tail_split > 1), SB_F32=int(sb_f32), OUT_F32=int(out_f32),
    )  # fmt: skip


def cubin(cfg: Fp8GemmCudaConfig, sb_f32: bool = False, out_f32: bool = False) -> bytes:
    """The compiled kernel (NVRTC, once per process per set of constants; no GPU needed)."""
    return _cubin(tuple(defines(cfg, sb_f32, out_f32).items()))


@functools.cache
def _cubin(constants: tuple[tuple[str, int], ...]) -> bytes:
    return module.compile_file(SOURCE, ARCH, dict(constants))


@functools.cache
def _kernel(constants: tuple[tuple[str, int], ...], device: int) -> module.Kernel:
    # each call takes the shared memory its K needs, up to DYNAMIC_SHARED: opt in to it all
    return module.load_kernel(
        _cubin(constants), "fp8_gemm", torch.device("cuda", device), DYNAMIC_SHARED
    )


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    batch_invariant: bool = False,
    config: Fp8GemmCudaConfig | None = None,
) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w * w_scale)^T`` with fp32 sums. x_fp8 [M, K] e4m3, x_scale
    [M, K/32] fp32 powers of two, w [N, K] e4m3, w_scale [ceil(N/32), K/32] e8m0 (or fp32 powers
    of two) -> [M, N] out_dtype (bfloat16 or float32). ValueError naming the problem when
    `call_reason` refuses the call. Without a config: `call_config`'s (batch_invariant:
    `invariant_config`'s K split, whose sums are the decode kernel's). A row's sums do
    not depend on M wherever the config's tail_split is 1 or its k_split (so in batch-invariant
    mode always); auto mode's cuts of other counts change the last wave's sums with M."""
    m = x_fp8.shape[0] if x_fp8.dim() == 2 else 0
    n, k = w.shape if w.dim() == 2 else (0, 0)  # bad shapes: refused by call_reason
    sms = module.sm_count(x_fp8.device)
    cfg = config or call_config(m, n, k, batch_invariant, sms)
    why = call_reason(x_fp8, x_scale, w, w_scale, out_dtype, cfg)
    if why is not None:
        raise ValueError(f"cuda fp8_gemm: {why}")
    (m, k), n = x_fp8.shape, w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    a_map = module.tensor_map_2d(x_fp8.data_ptr(), m, k, BLOCK_K, BLOCK_M, swizzle_128b=True)
    b_map = module.tensor_map_2d(w.data_ptr(), n, k, BLOCK_K, cfg.block_n, swizzle_128b=True)
    sa_map = module.tensor_map_2d(x_scale.data_ptr(), m, k // 8, 16, BLOCK_M)
    last_box = module.tail_box(m, BLOCK_M)  # the last row tile's boxes: its rows, up to 8
    a_last = module.tensor_map_2d(x_fp8.data_ptr(), m, k, BLOCK_K, last_box, swizzle_128b=True)
    sa_last = module.tensor_map_2d(x_scale.data_ptr(), m, k // 8, 16, last_box)
    # the tile's sums leave as boxes of 64 rows x 128 bytes (the kernel's staging layout)
    out_map = module.tensor_map_2d(
        out.data_ptr(), m, n * out.element_size(), 128, 64, swizzle_128b=True
    )
    tiles = tiles_of(m, n, cfg.block_n)
    split = min(cfg.tail_split, k // BLOCK_K)  # pieces of one stage at least
    tail = tiles % sms if split > 1 else 0  # the last partial wave's tiles, cut into pieces
    ctas = tiles - tail + tail * split  # one per tile or piece, or per SM (persistent)
    if cfg.persistent:
        ctas = min(ctas, sms)
    # the pieces' fp32 sums, [tail tile][chunk][128 x block_n] (a piece is one chunk without a K
    # split); a count of pieces done per tile
    slots = cfg.k_split if cfg.k_split > 1 else split
    ws = torch.empty(tail * slots * BLOCK_M * cfg.block_n, device=x_fp8.device) if tail else None
    arrivals = torch.zeros(tail, dtype=torch.int32, device=x_fp8.device) if tail else None
    sb_f32, out_f32 = w_scale.dtype == torch.float32, out_dtype == torch.float32
    constants = tuple(defines(cfg, sb_f32, out_f32).items())
    chunk_steps = k // BLOCK_K // cfg.k_split
    maps = (a_map, b_map, sa_map, a_last, sa_last, out_map)
    shape = (m, n, k, chunk_steps, last_box)
    args = (*maps, w_scale, *shape, ws, arrivals, tiles - tail, split)
    _kernel(constants, module.device_index(x_fp8.device)).launch(
        (ctas,), THREADS, args, shared_bytes(k, cfg)
    )
    return out
