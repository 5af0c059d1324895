"""Swap-AB FP8 decode GEMM in CUDA C++ (`decode_gemm.cu`), meant for M <= 256 tokens: the weight
is the FP8 wgmma's A operand (64 rows per consumer warpgroup, fed by the TMA through a ring of
128-deep K stages), the tokens its B operand (a token tile of 8 / 16 / 32 / 64; at 64 the other
way round: fewer scale products per thread, the same dot products); each k32 slice's partial is
promoted with its weight and token scales. The K chunks of a weight tile (`k_split`, a function
of (N, K) only) run as one thread-block cluster and are summed in chunk order through
distributed shared memory, so a call is one kernel and a row's bits do not depend on M or on the
config.

By default a call is a programmatic dependent launch: its prologue and first weight stages run
while the kernel before it ends, and it reads the activations (and writes the output) only after
that kernel has finished. The contract this asks of the caller: the kernel launched just before
does not write the weights or their scales (inference never does; a weight update followed at
once by this GEMM should pass `DecodeGemmCudaConfig(programmatic=False)`).

Same contract as `ref.linear.fp8_gemm`. Which calls run here and with which config is decided in
`ops/linear.py`; compiled by NVRTC at first use (once per process per config).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from . import module
from .module import check_fields

SOURCE = Path(__file__).with_name("decode_gemm.cu")
ARCH = "sm_90a"
BLOCK_K = 128  # K values per ring stage (one 128-byte swizzle row of e4m3)
MAX_TOKENS = 64  # the widest token tile (wgmma N)
MAX_SPLIT = 8  # K chunks per weight tile: a cluster of at most 8 CTAs (the portable size)
SM_SHARED = 228 * 1024  # shared memory of one SM; each resident CTA takes 1 KiB more of it
REGS_PER_SM = 65536
PRODUCER_REGS = 24  # the TMA warpgroup's registers after setmaxnreg (decode_gemm.cu)
STATIC_SHARED = 256  # the ring's barriers (static shared memory), rounded up


@dataclass(frozen=True)
class DecodeGemmCudaConfig:
    """consumers: warpgroups of 64 weight rows per CTA (1 or 2: 64- or 128-row tiles; two share
    each stage's token tile); min_blocks: CTAs per SM the registers and the ring are cut for
    (1..4; every CTA of a call should be resident at once); stages: 128-deep K stages in the
    ring (0: as many as `min_blocks` CTAs per SM leave room for, at most 12); programmatic: launch
    as a programmatic dependent of the kernel before (its prologue and first weight stages
    overlap that kernel's end; see the module's contract). None of these changes a sum."""

    consumers: int = 2
    min_blocks: int = 2
    stages: int = 0
    programmatic: bool = True

    def __post_init__(self) -> None:
        checks = (
            ("consumers", self.consumers in (1, 2), "1 or 2"),
            ("min_blocks", 1 <= self.min_blocks <= 4, "1..4"),
            ("stages", self.stages == 0 or 2 <= self.stages <= 12, "0 (auto) or 2..12"),
            ("programmatic", isinstance(self.programmatic, bool), "a bool"),
        )
        check_fields(self, checks)

    @property
    def rows(self) -> int:
        """Weight rows per CTA."""
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)


DEFAULT = DecodeGemmCudaConfig()


def fill_config(m: int, n: int, k: int, sms: int) -> DecodeGemmCudaConfig:
    """The rule for shapes not measured: the weight tile (64 or 128 rows) whose CTAs (weight
    tiles x K chunks x token tiles) fill the SMs' slots most evenly (128 rows on a tie: half the
    token-tile reloads), and as many CTAs per SM as hold them all at once: 64-row tiles 3 or 4,
    128-row tiles 2 (more would leave their consumers under 64 registers; more CTAs than that run
    in waves). None of these changes a sum."""
    split, tiles_t = k_split(n, k), -(-m // token_tile(m))

    def ctas(consumers: int) -> int:
        return -(-n // (64 * consumers)) * split * tiles_t

    def fill(consumers: int) -> float:
        return ctas(consumers) / (sms * -(-ctas(consumers) // sms))

    if fill(1) > fill(2) + 0.05:
        return DecodeGemmCudaConfig(1, min(4, max(3, -(-ctas(1) // sms))))
    return DecodeGemmCudaConfig(2, 2)


NUM_SMS = 132
"""The SM count `k_split` aims at: a constant, not read from the device, so that the split (and
with it every row's bits) is a function of (N, K) alone."""


@functools.lru_cache(maxsize=4096)  # pure; called on every routed call
def k_split(n: int, k: int) -> int:
    """K chunks for an [N, K] weight, a function of (N, K) only: doubles from 1 while there are
    fewer than 2 CTAs per SM of 64-row weight tiles x chunks, a chunk keeps >= 1024 columns and
    stays a multiple of 128 (whole stages). The prefill kernel cuts K the same way in
    batch-invariant mode (`prefill_gemm.invariant_config`), so both give a row the same bits."""
    tiles = -(-n // 64)
    s = 1
    while tiles * s < 2 * NUM_SMS and k % (2 * s * BLOCK_K) == 0 and k // (2 * s) >= 1024:
        s *= 2
    return s


def token_tile(m: int) -> int:
    """Tokens per CTA (the wgmma's N) for M tokens: the smallest of 8 / 16 / 32 / 64 that holds
    M (64 above: several token tiles)."""
    return next((t for t in (8, 16, 32) if m <= t), MAX_TOKENS)


def stage_bytes(tokens: int, cfg: DecodeGemmCudaConfig) -> int:
    """One ring stage: the weight box (rows x 128 bytes), the token box (tokens x 128, at least
    1 KiB) and the tokens' scales (1 KiB)."""
    return cfg.rows * BLOCK_K + max(tokens * BLOCK_K, 1024) + 1024


def table_bytes(k: int, split: int, cfg: DecodeGemmCudaConfig) -> int:
    """The chunk's weight scales for the tile's rows as floats: [K / split / 32][rows / 32]."""
    return k // split // 32 * (cfg.rows // 32) * 4


def stages_for(tokens: int, k: int, split: int, cfg: DecodeGemmCudaConfig) -> int:
    """cfg.stages, or (0) as many as `min_blocks` CTAs per SM leave room for (at most 12, and
    within the shared memory one CTA may take)."""
    if cfg.stages:
        return cfg.stages
    per_cta = min(SM_SHARED // cfg.min_blocks - 1024, module.MAX_SHARED)  # 1 KiB CTA reserve
    free = per_cta - STATIC_SHARED - 1024 - table_bytes(k, split, cfg)  # barriers, align slack
    return min(12, free // stage_bytes(tokens, cfg))


def shared_bytes(tokens: int, k: int, split: int, cfg: DecodeGemmCudaConfig) -> int:
    """Dynamic shared memory of a call: the ring, the scale table, 1 KiB to align the ring."""
    stages = stages_for(tokens, k, split, cfg)
    return stages * stage_bytes(tokens, cfg) + table_bytes(k, split, cfg) + 1024


def consumer_regs(cfg: DecodeGemmCudaConfig) -> int:
    """Registers per consumer thread after setmaxnreg: what `min_blocks` CTAs per SM leave once
    the producer warpgroup has given its registers back (a multiple of 8, at most 240)."""
    launch = min(255, REGS_PER_SM // (cfg.threads * cfg.min_blocks)) // 8 * 8
    free = launch * cfg.threads - PRODUCER_REGS * 128
    return min(240, free // (128 * cfg.consumers) // 8 * 8)


def pipelined(tokens: int, cfg: DecodeGemmCudaConfig) -> bool:
    """Whether the consumers keep the next slice's wgmma in flight while they promote one: where
    a second partial fits their registers (two partials, the sums and the scales take 5/4 x
    tokens, addresses ~40 more; otherwise ptxas spills). Bits unchanged either way."""
    return tokens * 5 // 4 + 40 <= consumer_regs(cfg)


def tokens_as_a(tokens: int) -> bool:
    """Whether the token tile is the wgmma's A operand and the weight rows its B: at 64 tokens,
    where a thread's sums then span 2 tokens x 2 row blocks (4 scale products per slice) instead
    of 16 tokens x 1. Bits unchanged (the same dot products)."""
    return tokens == MAX_TOKENS


def scale_vec(tokens: int) -> int:
    """Slices whose token scales the consumers read with one shared load when the weight rows
    are A: a stage's 4 (a thread's 2 x tokens / 8 token scales x 4 slices in registers). At 64
    tokens, where the tokens are A, a thread reads its 2 tokens' stage of scales in one load
    each and this is not used."""
    return 4 if tokens <= 32 else 1


@functools.lru_cache(maxsize=4096)  # pure; called on every routed call
def shape_reason(
    n: int, k: int, m: int = 1, cfg: DecodeGemmCudaConfig | None = None, sms: int = 132
) -> str | None:
    """Why the kernel cannot take w [N, K] at M tokens with this config, or None: K a positive
    multiple of 128 split into at most 8 whole-stage chunks, N a positive multiple of 8, the
    ring (at least 2 stages) and the chunk's sums within shared memory. Without a config:
    `fill_config`'s on `sms` SMs."""
    if k % BLOCK_K or k <= 0:
        return f"K={k} must be a positive multiple of {BLOCK_K}"
    if n % 8 or n <= 0:
        return f"N={n} must be a positive multiple of 8"
    cfg = cfg or fill_config(max(m, 1), n, k, sms)
    split = k_split(n, k)
    if split > MAX_SPLIT:
        return f"the K split {split} is over the {MAX_SPLIT} CTAs of a portable cluster"
    tokens = token_tile(m)
    stages = stages_for(tokens, k, split, cfg)
    if stages < 2:
        return f"fewer than 2 stages fit at K={k} with {cfg.min_blocks} CTAs per SM"
    if shared_bytes(tokens, k, split, cfg) > module.MAX_SHARED - STATIC_SHARED:
        return f"{stages} stages need more shared memory than a CTA may take"
    if tokens * (cfg.rows + 4) * 4 > stages * stage_bytes(tokens, cfg):
        return f"the chunk's sums ({tokens} x {cfg.rows}) do not fit in {stages} stages"
    if consumer_regs(cfg) < 64:
        return f"{consumer_regs(cfg)} registers per consumer thread at {cfg.min_blocks} per SM"
    return None


def call_reason(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: DecodeGemmCudaConfig | None = None,
) -> str | None:
    """Why `decode_gemm` cannot run this call here (the operands: dtypes, shapes, layout,
    alignment; then this kernel's shape limits), or None."""
    why = module.operand_reason(x_fp8, x_scale, w, w_scale, out_dtype)
    sms = module.sm_count(x_fp8.device)
    why = why or shape_reason(w.shape[0], w.shape[1], x_fp8.shape[0], cfg, sms)
    return why or module.launch_reason(x_fp8)


def defines(
    tokens: int, split: int, stages: int, cfg: DecodeGemmCudaConfig, sb_f32: bool, out_f32: bool
) -> dict[str, int]:
    """The kernel's compile-time constants."""
    return dict(
        CONSUMERS=cfg.consumers, TOKENS=tokens, STAGES=stages, SPLIT=split,
        MIN_BLOCKS=cfg.min_blocks, CONSUMER_REGS=consumer_regs(cfg),
        PIPELINED=int(pipelined(tokens, cfg)), TOKENS_AS_A=int(tokens_as_a(tokens)),
        SCALE_VEC=scale_vec(tokens),
        SB_F32=int(sb_f32), OUT_F32=int(out_f32),
    )  # fmt: skip


@functools.cache
def cubin(
    tokens: int, split: int, stages: int, cfg: DecodeGemmCudaConfig, sb_f32: bool, out_f32: bool
) -> bytes:
    return module.compile_file(SOURCE, ARCH, defines(tokens, split, stages, cfg, sb_f32, out_f32))


@functools.cache
def _kernel(
    tokens: int, split: int, stages: int, cfg: DecodeGemmCudaConfig, flags: tuple, device: int
) -> module.Kernel:
    return module.load_kernel(
        cubin(tokens, split, stages, cfg, *flags),
        "decode_gemm",
        torch.device("cuda", device),
        module.MAX_SHARED - STATIC_SHARED,
    )


def decode_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: DecodeGemmCudaConfig | None = None,
) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w * w_scale)^T`` with fp32 sums. x_fp8 [M, K] e4m3, x_scale
    [M, K/32] fp32 powers of two, w [N, K] e4m3, w_scale [ceil(N/32), K/32] e8m0 (or fp32 powers
    of two) -> [M, N] out_dtype (bfloat16 or float32); any M (token tiles of up to 64), meant for
    M <= 256. A row's bits do not depend on M or the config (default: `fill_config`'s).
    ValueError naming the problem when `call_reason` refuses the call."""
    why = call_reason(x_fp8, x_scale, w, w_scale, out_dtype, config)
    if why is not None:
        raise ValueError(f"cuda decode_gemm: {why}")
    (m, k), n = x_fp8.shape, w.shape[0]
    dev = module.device_index(x_fp8.device)
    cfg = config or fill_config(m, n, k, module.sm_count(x_fp8.device))
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    tokens, split = token_tile(m), k_split(n, k)
    stages = stages_for(tokens, k, split, cfg)
    w_map = module.tensor_map_2d(w.data_ptr(), n, k, BLOCK_K, cfg.rows, swizzle_128b=True)
    tail = module.tail_box(m, tokens)
    maps = [  # the full token tiles' boxes, then the last tile's
        (
            module.tensor_map_2d(x_fp8.data_ptr(), m, k, BLOCK_K, box, swizzle_128b=True),
            module.tensor_map_2d(x_scale.data_ptr(), m, k // 8, 16, box),
        )
        for box in (tokens, tail)
    ]
    flags = (w_scale.dtype == torch.float32, out_dtype == torch.float32)
    _kernel(tokens, split, stages, cfg, flags, dev).launch(
        (-(-n // cfg.rows) * split * -(-m // tokens), 1),
        cfg.threads,
        (w_map, *maps[0], *maps[1], w_scale, out, m, n, k, tail),
        shared_bytes(tokens, k, split, cfg),
        programmatic=cfg.programmatic,
    )
    return out
