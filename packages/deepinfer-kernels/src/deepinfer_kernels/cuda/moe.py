"""Routed FP4 experts' two GEMMs in CUDA C++: the `cuda` tier of `moe_experts` (`ops/moe.py`
routes the tokens and quantises the activations with the Triton tier's kernels, runs these,
then combines). Two kernel pairs: mma.sync (`moe_mma.cu`), the fastest at decode sizes, loading
its weights through shared memory from the tensor-memory accelerator (TMA) or straight into
registers (REGISTER: for weights the TMA cannot copy; the same sums); and wgmma
(`moe_wgmma.cu`), whose fp32 sums are those of the Triton tier's prefill tiles, so that a routed
row's bits do not depend on the batch or on which path ran it (batch-invariant mode), with
128- or 160-token routing tiles that the TMA streams through shared memory at prefill sizes.

Same contract and numerics as `ref.moe.moe_experts`: activations quantised per 32 to FP8 and
expanded exactly to bf16, FP4 weights expanded exactly to bf16 in registers, fp32 sums; gate/up
rounded to x.dtype, clamped SwiGLU x routing weight rounded to x.dtype, quantised per 32 to FP8
for W2; each routed row's W2 output rounded to x.dtype. Only the fp32 summation order differs
from the reference (mma.sync: K split across SPLIT warps, summed in warp order; wgmma: one chain
of k16 steps over all of K, in order). Compiled by NVRTC at first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..quant import ACT_AMAX_FLOOR
from . import module
from .module import MAX_SHARED, check_fields

SOURCE = Path(__file__).with_name("moe_mma.cu")
WGMMA_SOURCE = Path(__file__).with_name("moe_wgmma.cu")
ARCH = "sm_90a"


@dataclass(frozen=True)
class MoeDecodeCudaConfig:
    """How the two GEMMs cut their work. rt*: 16-row weight tiles per warp (W1/W3: per matrix,
    even, so that a warp holds whole 32-column FP8 groups of h); split*: warps per CTA, each a
    contiguous share of K (the partials summed in warp order); min_blocks*: the CTAs per SM the
    register allocation must allow (`__launch_bounds__`); tile_tokens: routed rows per routing
    tile (8 or 16: one or two n8 mma columns per expanded weight fragment); depth: K steps whose
    loads are in flight while one computes (1 or 2; each costs a register set). The fp32 sums
    depend on K, split1 and split2 only: configs with the same splits give the same bits.

    tma: the weights reach shared memory as tensor-map boxes that one lane per warp asks for
    `depth` K steps ahead (1..8 stages, no register cost), each with the tokens' slices of that
    step (bulk copies), and the scales once per CTA; the register loads leave HBM underused.
    The stages grow with the tile's tokens (at most min(T, tile_tokens))."""

    rt1: int = 2
    split1: int = 4
    min_blocks1: int = 3
    rt2: int = 4
    split2: int = 2
    min_blocks2: int = 6
    tile_tokens: int = 8
    depth: int = 1
    tma: bool = False

    def __post_init__(self) -> None:
        checks = (
            ("rt1", self.rt1 in (2, 4), "2 or 4"),
            ("rt2", self.rt2 in (1, 2, 4), "1, 2 or 4"),
            ("split1", 1 <= self.split1 <= 8, "1..8"),
            ("split2", 1 <= self.split2 <= 8, "1..8"),
            ("min_blocks1", 1 <= self.min_blocks1 <= 8, "1..8"),
            ("min_blocks2", 1 <= self.min_blocks2 <= 8, "1..8"),
            ("tile_tokens", self.tile_tokens in (8, 16), "8 or 16"),
            ("tma", isinstance(self.tma, bool), "a bool"),
            (
                "depth",
                1 <= self.depth <= 8 if self.tma is True else self.depth in (1, 2),
                "1..8 (tma) or 1 or 2",
            ),
        )
        check_fields(self, checks)


REGISTER = MoeDecodeCudaConfig()
"""The register-loop kernels: for weights or scales that are not 16-byte aligned."""
TMA = MoeDecodeCudaConfig(tma=True, depth=2)
"""REGISTER's splits (the same bits) fed by the tensor-memory accelerator, 2 stages per warp."""
TMA_TILE16 = MoeDecodeCudaConfig(tma=True, depth=2, tile_tokens=16)
"""TMA with 16-token routing tiles (two mma columns per weight fragment; the same bits)."""


@dataclass(frozen=True)
class MoeDecodeWgmmaConfig:
    """The wgmma kernels' knobs (none changes a sum):
    - tile_tokens: routed rows per routing tile (8, 16, 32, 64, 128 or 160: the wgmma's N; from
      64, a tile's wgmmas cover its tokens rounded up to 32);
    - depth1 / depth2: K steps (128 values) whose weight loads are in flight while one
      computes (1..8);
    - min_blocks1 / min_blocks2: the CTAs per SM the register allocation must allow (1..8);
    - warpgroups1 / warpgroups2: warpgroups per CTA, sharing the tile's activations in shared
      memory: 1 or 2 (64 weight rows each), or 4 (W1/W3: W1 on two and W3 on two, so that a
      thread holds one matrix's sums; W2: 4 x 64 rows);
    - row_sets2: sets of 64 x warpgroups2 W2 rows per CTA (1 or 2: more rows per activation
      byte read);
    - x_stages: 0, the tile's activations over all of K reach shared memory before the first
      step (decode tiles), or 3..8, a ring of that many K steps refilled x_stages - 2 steps
      ahead (prefill tiles, whose K does not fit);
    - tail_depth: the load depth of both kernels' tail variants (from 64-token tiles, the K
      loops whose wgmmas cover at most half the tile: less work per step to hide a load behind,
      and half the accumulators' registers free), 1..8, or 0: depth1 / depth2;
    - pinned_loads: the weight and scale loads are plain `ld.global` instead of the
      non-coherent `ld.global.nc`, which ptxas may not move past the step's barrier: it keeps
      them a step ahead instead of sinking them next to their use to free registers;
    - x_tma: one thread fills the activation ring (x_stages) by the tensor-memory accelerator
      from the routed rows in tile order (W1/W3: gathered as they are quantised; W2: h as it
      is), 128-byte swizzled, instead of every thread's cp.async (tiles of 32 tokens or more);
    - wgmma_groups: wgmma groups (a K step's quarter each) a warpgroup keeps in flight while it
      expands the next group's weights: 1..3 (each keeps one more group's weight fragments
      live; 3 fits 128 registers with w_tma only, and not with the byte exchange);
    - w_tma: the weights' packed bytes come through the activation ring too, one TMA box of a
      row set's rows per matrix and K step, x_stages - 2 steps ahead, instead of each thread's
      loads depth1 / depth2 steps ahead (which then apply to the scale bytes only): no weight
      bytes in flight in registers (needs x_tma).

    fragment_weights: w1, w3 and w2 are in `quant.fp4_fragment_order`, which saves each K step the
    byte exchange through shared memory (the same sums: the same bits); WGMMA_FRAGMENT is the
    default for such weights.

    permuted_k: on the checkpoint's order, each thread feeds its own 32-value group to its
    fragment slots, so K runs permuted within each 128-value step (`k_permutation`; the caller
    permutes the activations' columns to match): no byte exchange, but not the prefill tiles'
    sums, so not for batch-invariant mode (WGMMA_PREFILL, auto mode's prefill)."""

    tile_tokens: int = 8
    depth1: int = 3
    depth2: int = 6
    min_blocks1: int = 2
    min_blocks2: int = 1
    warpgroups1: int = 2
    warpgroups2: int = 1
    row_sets2: int = 1
    x_stages: int = 0
    tail_depth: int = 0
    pinned_loads: bool = False
    x_tma: bool = False
    wgmma_groups: int = 1
    w_tma: bool = False
    fragment_weights: bool = False
    permuted_k: bool = False

    def __post_init__(self) -> None:
        checks = (
            (
                "tile_tokens",
                self.tile_tokens in (8, 16, 32, 64, 128, 160),
                "8, 16, 32, 64, 128 or 160",
            ),
            ("depth1", 1 <= self.depth1 <= 8, "1..8"),
            ("depth2", 1 <= self.depth2 <= 8, "1..8"),
            ("min_blocks1", 1 <= self.min_blocks1 <= 8, "1..8"),
            ("min_blocks2", 1 <= self.min_blocks2 <= 8, "1..8"),
            ("warpgroups1", self.warpgroups1 in (1, 2, 4), "1, 2 or 4"),
            ("warpgroups2", self.warpgroups2 in (1, 2, 4), "1, 2 or 4"),
            ("row_sets2", self.row_sets2 in (1, 2), "1 or 2"),
            ("x_stages", self.x_stages == 0 or 3 <= self.x_stages <= 8, "0 or 3..8"),
            ("tail_depth", 0 <= self.tail_depth <= 8, "0..8"),
            ("pinned_loads", isinstance(self.pinned_loads, bool), "a bool"),
            (
                "x_tma",
                isinstance(self.x_tma, bool)
                and not (self.x_tma and (self.x_stages == 0 or self.tile_tokens < 32)),
                "a bool, and False without x_stages or below 32-token tiles",
            ),
            ("wgmma_groups", self.wgmma_groups in (1, 2, 3), "1, 2 or 3"),
            (
                "w_tma",
                isinstance(self.w_tma, bool) and not (self.w_tma and not self.x_tma),
                "a bool, and False without x_tma",
            ),
            ("fragment_weights", isinstance(self.fragment_weights, bool), "a bool"),
            (
                "permuted_k",
                isinstance(self.permuted_k, bool)
                and not (self.permuted_k and self.fragment_weights),
                "a bool, and False with fragment_weights",
            ),
        )
        check_fields(self, checks)


WGMMA_DEFAULT = MoeDecodeWgmmaConfig()
WGMMA_FRAGMENT = MoeDecodeWgmmaConfig(
    fragment_weights=True, min_blocks1=1, depth1=4, warpgroups1=4, pinned_loads=True
)
"""On fragment-order weights (the default W1/W3 schedule spills there: the loaded words now live
until their group's wgmma), W1 and W3 on separate warpgroup pairs (16 warps per CTA at 93
registers)."""
WGMMA_PREFILL_FRAGMENT = MoeDecodeWgmmaConfig(
    tile_tokens=128, depth1=2, depth2=2, min_blocks1=1, min_blocks2=1, warpgroups1=4,
    warpgroups2=4, x_stages=4, pinned_loads=True, x_tma=True, wgmma_groups=3, w_tma=True,
    fragment_weights=True,
)  # fmt: skip
"""Prefill-sized routing on fragment-order weights: 128-token tiles (the wgmmas of a tail tile
cover its tokens rounded up to 32), 4 warpgroups (W1 on two, W3 on two), the activations and
the weights' bytes by TMA through a ring of 4 K steps, the scales loaded 2 K steps ahead
(pinned loads), two wgmma groups in flight while the next expands."""
WGMMA_PREFILL = replace(WGMMA_PREFILL_FRAGMENT, fragment_weights=False, permuted_k=True)
"""Auto mode's prefill (the checkpoint's order outside batch-invariant mode): the fragment
schedule with K permuted instead of the byte exchange."""
WGMMA_PREFILL_EXCHANGE = replace(WGMMA_PREFILL_FRAGMENT, fragment_weights=False, wgmma_groups=2)
"""Batch-invariant mode's prefill on the checkpoint's order: the fragment schedule with the byte
exchange per K step (the prefill tiles' sums), one wgmma group in flight (two spill here)."""
WIDE_TILE_TOKENS = 160


def wide_tiles(cfg: MoeDecodeWgmmaConfig) -> MoeDecodeWgmmaConfig:
    """Prefill config cfg on 160-token routing tiles (wgmma N up to 160): the weights by TMA
    through a ring of 3 K steps (4 do not fit shared memory), one wgmma group in flight while
    the next expands, which fits the 4-warpgroup kernels' 128 registers (the same sums: the same
    bits)."""
    return replace(
        cfg,
        tile_tokens=WIDE_TILE_TOKENS,
        x_stages=3,
        w_tma=True,
        wgmma_groups=2,
    )


WGMMA_ROWS = 64  # weight rows per warpgroup (its M)


def k_permutation(k: int) -> torch.Tensor:
    """The column order [k] in which `permuted_k` kernels sum K: within each 128-value step, k16
    step s's slot 8 hi + 2t + e (t: the quad lane, hi: the slot half, e: the pair element) holds
    value 32t + 4s + 2hi + e (thread t's own scale group, in natural order); activations go in as
    x[:, k_permutation(k)]."""
    slot = torch.arange(128)
    s, hi, t, e = slot // 16, (slot // 8) % 2, (slot % 8) // 2, slot % 2
    step = 32 * t + 4 * s + 2 * hi + e
    return (torch.arange(0, k, 128)[:, None] + step[None, :]).reshape(-1)


Config = MoeDecodeCudaConfig | MoeDecodeWgmmaConfig


def _wgmma_mats(kind: str, cfg: MoeDecodeWgmmaConfig) -> int:
    """Weight row sets per thread of wgmma kernel `kind` (its MATS): W1/W3 both, or one of them
    with W1 and W3 on separate warpgroup pairs; W2's row sets."""
    if kind == "w13":
        return 1 if cfg.warpgroups1 == 4 else 2
    return cfg.row_sets2


def _wgmma_rows(kind: str, cfg: MoeDecodeWgmmaConfig) -> int:
    """The weight rows (of each matrix) that one CTA of wgmma kernel `kind` computes."""
    if kind == "w13":
        return WGMMA_ROWS * (2 if cfg.warpgroups1 == 4 else cfg.warpgroups1)
    return WGMMA_ROWS * cfg.warpgroups2 * cfg.row_sets2


def _wgmma_shared_bytes(kind: str, k: int, cfg: MoeDecodeWgmmaConfig) -> int:
    """The dynamic shared memory of wgmma kernel `kind` with reduction length k (the .cu's
    DYN_BYTES): the routing tile's bf16 activations, over all of K or x_stages K steps of 128;
    with W1 and W3 on separate warpgroup pairs at least W3's fp32 sums (8 warps x 32 lanes x 4 per
    8 tokens), which that memory takes to W1's warpgroups afterwards; with w_tma each stage's
    weight boxes (64 bytes per row of the CTA's); with x_tma 1 KiB more, to start the swizzled
    stages on 1024 bytes."""
    x_bytes = (128 * cfg.x_stages if cfg.x_stages else k) * cfg.tile_tokens * 2
    split_gate = kind == "w13" and cfg.warpgroups1 == 4
    w3_sums = 8 * 32 * 4 * 4 * (cfg.tile_tokens // 8) if split_gate else 0
    w_rows = _wgmma_rows(kind, cfg) * (2 if kind == "w13" else 1)
    w_bytes = cfg.x_stages * w_rows * 64 if cfg.w_tma else 0
    return max(x_bytes, w3_sums) + w_bytes + (1024 if cfg.x_tma else 0)


def _wgmma_static_bytes(kind: str, cfg: MoeDecodeWgmmaConfig) -> int:
    """The static shared memory of wgmma kernel `kind` (moe_wgmma.cu), as the cubin
    declares it: each warp's scratch for one K step of packed bytes (none with fragment-order
    weights), W1/W3's per-warp amax exchange, the tile's token row addresses (with x_tma a
    barrier per stage instead; 128-byte aligned) and the 1 KiB that sm_90 reserves per CTA."""
    warps = 4 * (cfg.warpgroups1 if kind == "w13" else cfg.warpgroups2)
    mats = _wgmma_mats(kind, cfg)
    amax = warps * cfg.tile_tokens * 4 if kind == "w13" else 0
    scratch = 0 if cfg.fragment_weights or cfg.permuted_k else warps * mats * 2 * 8 * 64
    rows = 8 * cfg.x_stages if cfg.x_tma else cfg.tile_tokens * 8
    rows = -(-rows // 128) * 128
    return scratch + amax + rows + 1024


def _tma_shared_bytes(kind: str, d: int, i: int, cfg: MoeDecodeCudaConfig, x_cap: int) -> int:
    """The dynamic shared memory of TMA kernel `kind` with room for x_cap tokens: moe_decode.cu's
    scale rows and per-warp stages (the weight boxes, then each token's 4 groups of bf16)."""
    k, rt, split = (d, cfg.rt1, cfg.split1) if kind == "w13" else (i, cfg.rt2, cfg.split2)
    mats, kg = (2 if kind == "w13" else 1), k // 32
    scales = -(-mats * 16 * rt * kg // 128) * 128
    return scales + split * cfg.depth * (mats * 16 * rt * 64 + x_cap * 4 * 64)


def shape_reason(d: int, i: int, cfg: Config = REGISTER) -> str | None:
    """Why the kernels cannot run hidden size d, expert width i, or None."""
    if d % 32 or i % 32:
        return f"D={d} and I={i} must be multiples of 32"
    if isinstance(cfg, MoeDecodeWgmmaConfig):
        if d % 128 or i % 128:
            return (
                f"D={d} and I={i} must be multiples of 128 (the wgmma tile's {WGMMA_ROWS} rows "
                "and K steps of 128)"
            )
        for name, n, rows in (
            ("I", i, _wgmma_rows("w13", cfg)),
            ("D", d, _wgmma_rows("w2", cfg)),
        ):
            if n % rows:
                return f"{name}={n} must be a multiple of {rows} (a CTA's weight rows)"
        for kind, k in (("w13", d), ("w2", i)):
            need = _wgmma_shared_bytes(kind, k, cfg) + _wgmma_static_bytes(kind, cfg)
            if need > MAX_SHARED:
                return (
                    f"the {kind} kernel needs {need} bytes of shared memory (a "
                    f"{cfg.tile_tokens}-token tile of K={k} activations"
                    f"{', the weight boxes' if cfg.w_tma else ''}), over {MAX_SHARED}"
                )
        return None
    if i % (16 * cfg.rt1):
        return f"I={i} must be a multiple of {16 * cfg.rt1} (rt1={cfg.rt1})"
    if d % (16 * cfg.rt2):
        return f"D={d} must be a multiple of {16 * cfg.rt2} (rt2={cfg.rt2})"
    for kind in ("w13", "w2") if cfg.tma else ():
        need = _tma_shared_bytes(kind, d, i, cfg, cfg.tile_tokens) + 2048  # + barriers, reserve
        if need > MAX_SHARED:
            return (
                f"the TMA {kind} kernel needs {need} bytes of shared memory for a "
                f"{cfg.tile_tokens}-token tile, over {MAX_SHARED}"
            )
    return None


def order_reason(batch_invariant: bool, config: Config | None, fragment_order: bool) -> str | None:
    """Why these kernels cannot take this mode, config and weight order together, or None."""
    if batch_invariant and config is not None and not isinstance(config, MoeDecodeWgmmaConfig):
        return (
            "batch-invariant mode runs the wgmma kernels, so config must be a "
            f"MoeDecodeWgmmaConfig, got {config!r}"
        )
    if batch_invariant and getattr(config, "permuted_k", False):
        return "config.permuted_k sums K in another order than the prefill tiles (not invariant)"
    if fragment_order and not batch_invariant and config is None:
        return (
            "fragment-order weights: the mma.sync kernels (outside batch-invariant mode) read the "
            "checkpoint's order"
        )
    weights = getattr(config, "fragment_weights", False)
    if config is not None and weights != fragment_order:
        return f"config.fragment_weights={weights} but fragment_order={fragment_order}"
    return None


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor starts on a 16-byte boundary (what the TMA kernels copy in bulk)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def call_reason(
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    scales: dict[str, torch.Tensor],
    cfg: Config = REGISTER,
) -> str | None:
    """Why `moe_experts` cannot run x [T, D] with these named weights (w1 [E, I, D/2] first) and
    scales here (device, dtypes, dims, alignment, NVRTC), or None."""
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}, the cuda experts take bfloat16"
    for name, s in scales.items():
        if s.dtype != torch.float8_e8m0fnu:
            return f"{name} is {s.dtype}, the cuda experts read float8_e8m0fnu scales"
    wgmma = isinstance(cfg, MoeDecodeWgmmaConfig)
    how = "the TMA kernels copy it in bulk" if getattr(cfg, "tma", False) else None
    how = "the wgmma kernels load it in 16-byte words" if wgmma else how
    for name, t in (*weights.items(), *scales.items()) if how else ():
        if not aligned(t):
            return f"{name} is not 16-byte aligned ({how})"
    why = shape_reason(x.shape[1], next(iter(weights.values())).shape[1], cfg)
    return why or module.launch_reason(x)


def defines(kind: str, d: int, i: int, cfg: Config) -> dict[str, int]:
    """The compile-time constants of kernel `kind` ("w13" or "w2") for these dims."""
    if kind not in ("w13", "w2"):
        raise ValueError(f"kernel kind must be 'w13' or 'w2', got {kind!r}")
    w13 = kind == "w13"
    shape = dict(K_DIM=d, N_DIM=i, MATS=2) if w13 else dict(K_DIM=i, N_DIM=d, MATS=1)
    if isinstance(cfg, MoeDecodeWgmmaConfig):
        shape["MATS"] = _wgmma_mats(kind, cfg)
        depth = cfg.depth1 if w13 else cfg.depth2
        return dict(
            shape, TOKG=cfg.tile_tokens // 8,
            MIN_BLOCKS=cfg.min_blocks1 if w13 else cfg.min_blocks2,
            DEPTH=depth, TAIL_DEPTH=cfg.tail_depth or depth,
            WG=cfg.warpgroups1 if w13 else cfg.warpgroups2,
            FRAGMENT_WEIGHTS=int(cfg.fragment_weights), GATED=int(w13),
            K_PERMUTED=int(cfg.permuted_k),
            X_STAGES=cfg.x_stages, PINNED_LOADS=int(cfg.pinned_loads),
            X_TMA=int(cfg.x_tma), WGMMA_GROUPS=cfg.wgmma_groups, W_TMA=int(cfg.w_tma),
        )  # fmt: skip
    return dict(
        shape, RT=cfg.rt1 if w13 else cfg.rt2, TOKG=cfg.tile_tokens // 8,
        SPLIT=cfg.split1 if w13 else cfg.split2,
        MIN_BLOCKS=cfg.min_blocks1 if w13 else cfg.min_blocks2, DEPTH=cfg.depth,
        TMA=int(cfg.tma),
    )  # fmt: skip


@functools.cache
def cubin(kind: str, d: int, i: int, cfg: Config) -> bytes:
    """The compiled kernel (NVRTC, once per process per shape and config; no GPU needed)."""
    source = WGMMA_SOURCE if isinstance(cfg, MoeDecodeWgmmaConfig) else SOURCE
    return module.compile_file(source, ARCH, defines(kind, d, i, cfg))


@functools.cache
def _kernel(kind: str, d: int, i: int, cfg: Config, device: int) -> module.Kernel:
    name = "moe_w13" if kind == "w13" else "moe_w2"
    shared = _launch_shape(kind, d, i, cfg)[2]
    return module.load_kernel(cubin(kind, d, i, cfg), name, torch.device("cuda", device), shared)


def _launch_shape(
    kind: str, d: int, i: int, cfg: Config, x_cap: int | None = None
) -> tuple[int, int, int]:
    """(CTAs per routing tile, threads per CTA, dynamic shared bytes) of kernel `kind`; a TMA
    kernel's shared memory holds x_cap token rows (default: a whole tile, the most it takes)."""
    n, k = (i, d) if kind == "w13" else (d, i)
    if isinstance(cfg, MoeDecodeWgmmaConfig):
        wg = cfg.warpgroups1 if kind == "w13" else cfg.warpgroups2
        return n // _wgmma_rows(kind, cfg), 128 * wg, _wgmma_shared_bytes(kind, k, cfg)
    rt, split = (cfg.rt1, cfg.split1) if kind == "w13" else (cfg.rt2, cfg.split2)
    shared = _tma_shared_bytes(kind, d, i, cfg, x_cap or cfg.tile_tokens) if cfg.tma else 0
    return n // (16 * rt), 32 * split, shared


@functools.lru_cache(maxsize=64)
def _map(address: int, rows: int, row_bytes: int, box_rows: int) -> module.TensorMap:
    return module.tensor_map_2d(address, rows, row_bytes, 64, box_rows)


def rows_map(x: torch.Tensor) -> module.TensorMap:
    """The x_tma kernels' map of contiguous bf16 rows x [rows, K]: boxes of 64 values (128
    bytes, swizzled) x 32 rows (not cached: x is a fresh tensor per call)."""
    return module.tensor_map_2d(
        x.data_ptr(), x.shape[0], x.shape[1] * 2, 128, 32, swizzle_128b=True
    )


def weight_map(w: torch.Tensor, box_rows: int) -> module.TensorMap:
    """The TMA kernels' map of a contiguous expert stack w [E, N, K/2]: its E * N rows of packed
    bytes, boxes of one 64-byte K step x box_rows rows (cached per address and shape)."""
    return _map(w.data_ptr(), w.shape[0] * w.shape[1], w.shape[2], box_rows)


def expert_gemms(
    xa: torch.Tensor,
    sorted_token: torch.Tensor,
    sorted_weight: torch.Tensor,
    tiles: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor,
    w3: torch.Tensor,
    s3: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    tokens: int,
    swiglu_limit: float,
    cfg: Config,
) -> torch.Tensor:
    """W1/W3 with the clamped SwiGLU x routing weight, then W2, over routed rows: xa the
    activations quantised and expanded to bf16 ([T, D], or with `x_tma` [P, D] in routing order;
    with `permuted_k` their columns in `k_permutation` order), the routing of
    `triton.moe.build_routing` on `cfg.tile_tokens`-row tiles (sorted_token / sorted_weight [P],
    tiles [n_tiles, 3]), `tokens` = T; weights as `moe_experts` takes them (contiguous, checked by
    `call_reason`). -> y [P, D] bf16, each routed row's W2 output (rows in routing order)."""
    d, i = w1.shape[2] * 2, w1.shape[1]
    p = sorted_token.shape[0]
    h = torch.empty(p, i, dtype=torch.bfloat16, device=xa.device)
    y = torch.empty(p, d, dtype=torch.bfloat16, device=xa.device)
    n_tiles = tiles.shape[0]
    dev = module.device_index(xa.device)
    # TMA kernels: the weight maps first, and room for the tile's token rows (a tile holds at
    # most T tokens) last
    maps1, maps2, tail, x_cap = (), (), (), None
    if getattr(cfg, "x_tma", False):
        maps1, maps2 = (rows_map(xa),), (rows_map(h),)
    if getattr(cfg, "w_tma", False):  # one box per matrix (W2: per row set) and K step
        rows1 = _wgmma_rows("w13", cfg)
        maps1 += (weight_map(w1, rows1), weight_map(w3, rows1))
        maps2 += (weight_map(w2, WGMMA_ROWS * cfg.warpgroups2),)
    if getattr(cfg, "tma", False):
        x_cap = min(tokens, cfg.tile_tokens)
        maps1 = (weight_map(w1, 16 * cfg.rt1), weight_map(w3, 16 * cfg.rt1))
        maps2 = (weight_map(w2, 16 * cfg.rt2),)
        tail = (x_cap,)
    ctas, threads, shared = _launch_shape("w13", d, i, cfg, x_cap)
    _kernel("w13", d, i, cfg, dev).launch(
        (ctas, n_tiles),
        threads,
        (
            *maps1, xa, w1, s1, w3, s3, sorted_token, sorted_weight, tiles, h,
            float(swiglu_limit), float(ACT_AMAX_FLOOR), *tail,
        ),
        shared,
    )  # fmt: skip
    ctas, threads, shared = _launch_shape("w2", d, i, cfg, x_cap)
    # from 2 tokens the TMA W2 starts its prologue (barriers, first weight stages, scales) under
    # W1/W3's last CTAs and waits for W1/W3's end before it reads h
    _kernel("w2", d, i, cfg, dev).launch(
        (ctas, n_tiles), threads, (*maps2, h, w2, s2, tiles, y, *tail), shared,
        programmatic=bool(tail) and tokens >= 2,
    )  # fmt: skip
    return y
