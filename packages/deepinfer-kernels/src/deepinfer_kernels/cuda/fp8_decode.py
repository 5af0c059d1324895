"""Dense FP8 GEMM at decode sizes on mma.sync (`fp8_decode.cu`): the `cuda` tier of `fp8_gemm`
and `fp8_linear` for M <= 64 outside batch-invariant mode.

Same contract and numerics as `ref.linear.fp8_gemm`: FP8 e4m3 activations with per-32 fp32
power-of-two scales times 32x32-block FP8 weights with UE8M0 scales, each 32-deep product summed
by the tensor core and promoted to fp32 with its two scales; only the fp32 summation order
differs (K split over a CTA's warps and over KS CTAs, both summed in a fixed order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from . import module

SOURCE = Path(__file__).with_name("fp8_decode.cu")
ARCH = "sm_90a"
MAX_M = 64
ROUTED_MAX_M = 16
"""The registry sends M <= ROUTED_MAX_M here (measured against the TileLang decode kernel and the
GEMV: NOTES.md); the kernel runs M <= MAX_M."""


@dataclass(frozen=True)
class Fp8DecodeConfig:
    """rt: 16-row weight tiles per warp (even: a CTA's rows are whole 32-row scale blocks);
    warps: warps per CTA, each a contiguous share of the CTA's K range; depth: K groups whose
    loads are in flight while one computes (0: by M, `SCHEDULE`); ks: CTAs along K (0: as many
    as fill the SMs in one wave, `pick_ks`); min_blocks: CTAs per SM the register allocation
    must allow (0: by M)."""

    rt: int = 2
    warps: int = 4
    depth: int = 0
    ks: int = 0
    min_blocks: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("rt", self.rt in (2, 4), "2 or 4"),
            ("warps", 1 <= self.warps <= 8, "1..8"),
            ("depth", 0 <= self.depth <= 4, "0..4"),
            ("ks", 0 <= self.ks <= 64, "0..64"),
            ("min_blocks", 0 <= self.min_blocks <= 8, "0..8"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(
                    f"Fp8DecodeConfig.{name} must be {allowed}, got {getattr(self, name)!r}"
                )


DEFAULT = Fp8DecodeConfig()

SCHEDULE = {1: (3, 4), 2: (3, 3), 4: (2, 2), 8: (1, 2)}
"""Token groups -> (depth, min_blocks) by default: the deepest ring that compiles without
spilling at that occupancy (sm_90a, NVRTC 13: 104 / 142 / 188 / 255 registers)."""


def token_groups(m: int) -> int:
    """8-token mma columns the kernel compiles for: 1, 2, 4 or 8 (M <= 64)."""
    return next(q for q in (1, 2, 4, 8) if m <= 8 * q)


def shape_reason(m: int, n: int, k: int, cfg: Fp8DecodeConfig = DEFAULT) -> str | None:
    """Why the kernel cannot run M x N x K, or None."""
    if not 1 <= m <= MAX_M:
        return f"M={m} is outside 1..{MAX_M}"
    if k % 32:
        return f"K={k} must be a multiple of 32"
    if n % (16 * cfg.rt):
        return f"N={n} must be a multiple of {16 * cfg.rt} (rt={cfg.rt})"
    return None


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def schedule(m: int, cfg: Fp8DecodeConfig) -> tuple[int, int]:
    """(depth, min_blocks) for M tokens: the config's, or `SCHEDULE`'s where it says 0."""
    depth, blocks = SCHEDULE[token_groups(m)]
    return cfg.depth or depth, cfg.min_blocks or blocks


def pick_ks(m: int, n: int, k: int, cfg: Fp8DecodeConfig, sms: int) -> int:
    """CTAs along K: enough that the row blocks x KS CTAs fill `sms` SMs at 4 CTAs each in one
    wave, while each warp keeps at least depth + 1 K groups."""
    if cfg.ks:
        return cfg.ks
    row_blocks = n // (16 * cfg.rt)
    most = max(1, (k // 32) // (cfg.warps * (schedule(m, cfg)[0] + 1)))
    return max(1, min(4 * sms // row_blocks, most))


def defines(m: int, n: int, k: int, ks: int, out_f32: bool, cfg: Fp8DecodeConfig) -> dict:
    """The compile-time constants for these dims."""
    depth, blocks = schedule(m, cfg)
    return dict(
        K_DIM=k, N_DIM=n, TOKG=token_groups(m), RT=cfg.rt, WARPS=cfg.warps, KS=ks,
        MIN_BLOCKS=blocks, DEPTH=depth, OUT_F32=int(out_f32),
    )  # fmt: skip


@functools.cache
def cubin(m_groups: int, n: int, k: int, ks: int, out_f32: bool, cfg: Fp8DecodeConfig) -> bytes:
    """The compiled kernel (NVRTC, once per process per shape; no GPU needed)."""
    return module.compile_file(SOURCE, ARCH, defines(8 * m_groups, n, k, ks, out_f32, cfg))


@functools.cache
def _kernel(
    m_groups: int, n: int, k: int, ks: int, out_f32: bool, cfg: Fp8DecodeConfig, device: int
) -> module.Kernel:
    cub = cubin(m_groups, n, k, ks, out_f32, cfg)
    return module.load_kernel(cub, "fp8_decode", torch.device("cuda", device))


@functools.cache
def _workspace(device: int, n: int, ks: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-split partials [ks, MAX_M, n] fp32 and the per-row-block counters (zeros; the kernel
    leaves them zero) of one weight shape. One GEMM of a shape runs at a time (one stream)."""
    part = torch.empty(ks, MAX_M, n, dtype=torch.float32, device=f"cuda:{device}")
    counters = torch.zeros(n // rows, dtype=torch.int32, device=f"cuda:{device}")
    return part, counters


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    batch_invariant: bool = False,
    config: Fp8DecodeConfig | None = None,
) -> torch.Tensor:
    """x_fp8 [M, K] e4m3 (M <= 64), x_scale [M, K/32] fp32, w [N, K] e4m3, w_scale [N/32, K/32]
    e8m0 -> [M, N] out_dtype (bf16 or fp32). Not batch-invariant (the K split follows the SM
    count), so `fp8_gemm_cuda_supports` refuses that mode."""
    if batch_invariant:
        raise NotImplementedError(
            "cuda fp8_gemm: batch-invariant mode needs the TileLang decode kernel (its rows match "
            "the prefill kernel's bit for bit)"
        )
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"cuda fp8_gemm: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if w_scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"cuda fp8_gemm: w_scale must be float8_e8m0fnu, got {w_scale.dtype}")
    cfg = config or DEFAULT
    m, k = x_fp8.shape
    n = w.shape[0]
    why = shape_reason(m, n, k, cfg)
    if why is not None:
        raise ValueError(f"cuda fp8_gemm: {why}")
    dev = x_fp8.device.index if x_fp8.device.index is not None else torch.cuda.current_device()
    ks = pick_ks(m, n, k, cfg, _sm_count(dev))
    rows = 16 * cfg.rt
    part = counters = None
    if ks > 1:
        key = (dev, n, ks, rows)
        if torch.cuda.is_current_stream_capturing() and key not in _CAPTURE_SAFE:
            ks = 1  # no workspace outside the graph's memory pool yet: no K split across CTAs
        else:
            part, counters = _workspace(*key)
            _CAPTURE_SAFE.add(key)
    y = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    kernel = _kernel(token_groups(m), n, k, ks, out_dtype == torch.float32, cfg, dev)
    kernel.launch(
        (n // rows, ks),
        32 * cfg.warps,
        (
            x_fp8.contiguous(), x_scale.contiguous(), w.contiguous(), w_scale.contiguous(), y, m,
            part, counters,
        ),
    )  # fmt: skip
    return y


_CAPTURE_SAFE: set[tuple[int, int, int, int]] = set()
"""Workspace keys allocated outside any CUDA-graph capture (so usable inside one)."""


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, batch_invariant: bool = False
) -> torch.Tensor:
    """x [..., K] (M = the leading elements <= 64) -> [..., N] x.dtype: x quantised per 32 to FP8
    (the Triton tier's kernel), then `fp8_gemm`."""
    from ..triton.quant import act_quant_fp8

    k = x.shape[-1]
    xq, xs = act_quant_fp8(x.reshape(-1, k))
    # fp16 goes through fp32: one rounding, as the reference's
    out = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    y = fp8_gemm(xq, xs, w, w_scale, out, batch_invariant=batch_invariant)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
