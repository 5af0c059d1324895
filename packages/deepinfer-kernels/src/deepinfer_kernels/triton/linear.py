"""Triton FP8 block-scaled GEMM: per-32 FP8 activations x 32x32-block FP8 weights, fp32 accumulate.

Scales change every 32 along K, so the K loop steps in multiples of 32. Both operands are
expanded exactly to bf16 in registers (e4m3 x 2**e is a bf16 value) and bf16 tensor-core dots
are chained into one fp32 accumulator: the same sum of exact products as the reference, in
another order.

`fp8_gemm` runs the tiled kernel below, or a decode kernel of `gemv.py` when its config is a
`gemv.DecodeConfig` (`ops/linear.py` decides by M). In batch-invariant mode K is split exactly
as the decode kernel splits it (a function of N and K only) and only wgmma tiles are used, which
give a row the same bits whatever the tile, so a row's result never depends on the other rows;
the GPU tests check this bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import dot_exact, e8m0_to_fp32, fp8_to_bf16_scaled
from .gemv import DecodeConfig, decode_gemm, decode_split, sum_splits


@dataclass(frozen=True)
class GemmConfig:
    """The tiled kernel's tiles: block_m x block_n outputs per program, split_k K slices (summed
    by `sum_splits` in order), block_k K per step (a multiple of 32), group_m m tiles per raster
    group."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    block_k: int = 32


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    k_chunk,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cs,
    stride_cm,
    BS_E8M0: tl.constexpr,
    A_BF16: tl.constexpr,
    F32_MATH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)  # clamped rows: loads need no mask
    rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    # K is a multiple of 32; a step covers BLOCK_K (KG scale groups), the last one masked
    KG: tl.constexpr = BLOCK_K // 32
    k_begin = pid_k * k_chunk
    k_end = tl.minimum(K, k_begin + k_chunk)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, KG)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + (k_begin + offs_k)[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + (k_begin + offs_k)[None, :]
    as_ptrs = as_ptr + rows_a[:, None] * stride_asm + (k_begin // 32 + offs_g)[None, :]
    bs_ptrs = bs_ptr + (rows_b // 32)[:, None] * stride_bsn + (k_begin // 32 + offs_g)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if KG == 1:  # a step is exactly one scale group: no masks
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            sb = tl.load(bs_ptrs)
        else:
            kmask = (k0 + offs_k) < k_end
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[None, :], other=0.0)
            sb = tl.load(bs_ptrs, mask=((k0 + offs_g * 32) < k_end)[None, :], other=0)
        if BS_E8M0:
            sb = e8m0_to_fp32(sb)
        # e4m3 x 2**e is exact in bf16: one accumulator chain, no promotion step
        if A_BF16:  # activations already expanded exactly to bf16 (x_fp8 * scale)
            a16 = a
        else:
            sa = tl.load(as_ptrs, mask=((k0 + offs_g * 32) < k_end)[None, :], other=0.0)
            a16 = fp8_to_bf16_scaled(a, sa, BLOCK_M, BLOCK_K, KG, F32_MATH)
        b16 = fp8_to_bf16_scaled(b, sb, BLOCK_N, BLOCK_K, KG, F32_MATH)
        acc = dot_exact(a16, tl.trans(b16), acc, F32_MATH)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        as_ptrs += KG
        bs_ptrs += KG

    c_rows = offs_m.to(tl.int64)
    c_ptrs = c_ptr + pid_k * stride_cs + c_rows[:, None] * stride_cm + offs_n[None, :]
    cmask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=cmask)


def decode_config(m: int, n: int, k: int, batch_invariant: bool) -> DecodeConfig:
    """The weight-streaming decode kernel's tiles for M <= 64 rows: swap-AB bf16 tiles with the
    activation rows padded to 16 or 64 (the wgmma's N), 128 K a step, K split by (N, K)."""
    return DecodeConfig(block_m=16 if m <= 16 else 64, split_k=decode_split(n, k, batch_invariant))


def tile_config(
    m: int, n: int, k: int, batch_invariant: bool, a_bf16: bool = False, num_sms: int = 132
) -> GemmConfig:
    """The tiled kernel's tiles by M bucket; a_bf16: the activations come expanded to bf16
    (`fp8_linear`), where a 64-deep step pays at large M. Auto mode adds split-K at M <= 256 until
    there are ~4 CTAs per SM; batch-invariant mode splits K exactly as the decode kernel
    (`decode_split(N, K)`, K/split per slice, fixed-order sum), so a row's bits do not depend on
    M across the decode/tiles boundary either (wgmma tiles of any shape give a row the same bits
    for the same split of K)."""
    bk = 32
    if m <= 256:
        bm, bn, warps, stages = 64, 128, 4, 5
    else:
        bm, bn, warps, stages, bk = 128, 128, 8, 4, (64 if a_bf16 else 32)
    if batch_invariant:
        return GemmConfig(bm, bn, decode_split(n, k, True), warps, stages, block_k=bk)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    while m <= 256 and tiles * split < 4 * num_sms and k // (split * 2) >= 512:
        split *= 2
    return GemmConfig(bm, bn, split, warps, stages, block_k=bk)


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    batch_invariant: bool = False,
    config: GemmConfig | DecodeConfig,
) -> torch.Tensor:
    """[M, K] e4m3 (+ [M, K/32] fp32 scales) x [N, K] e4m3 (+ [N/32, K/32] e8m0) -> [M, N] on
    `config`'s kernel (`ops.linear` picks it: `gemv.gemv_config`, `decode_config`,
    `tile_config`).

    x_fp8 may instead be bf16 activations already expanded (x_fp8 * scale, see `fp8_linear`);
    x_scale is then ignored. In batch-invariant mode the tiles split K in K/split_k slices, and
    split_k must divide K/32.
    """
    m, k = x_fp8.shape
    n = w.shape[0]
    cfg = config
    if isinstance(cfg, DecodeConfig):
        return decode_gemm(x_fp8, x_scale, w, w_scale, out_dtype, cfg)
    x_fp8, x_scale, w = x_fp8.contiguous(), x_scale.contiguous(), w.contiguous()
    e8m0 = w_scale.dtype == torch.float8_e8m0fnu
    ws = (w_scale.view(torch.uint8) if e8m0 else w_scale.float()).contiguous()
    if m == 0:
        return torch.empty(0, n, dtype=out_dtype, device=x_fp8.device)
    bk = cfg.block_k
    if batch_invariant:  # the decode kernel's cut: K/split per slice
        if (k // 32) % cfg.split_k:
            raise ValueError(f"fp8_gemm: split_k={cfg.split_k} must divide K/32={k // 32}")
        k_chunk = k // cfg.split_k
    else:
        k_chunk = triton.cdiv(triton.cdiv(k, bk), cfg.split_k) * bk
    if cfg.split_k > 1:
        c = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x_fp8.device)
    else:
        c = torch.empty(1, m, n, dtype=out_dtype, device=x_fp8.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _fp8_gemm_kernel[grid](
        x_fp8,
        x_scale,
        w,
        ws,
        c,
        m,
        n,
        k,
        k_chunk,
        x_fp8.stride(0),
        x_scale.stride(0),
        w.stride(0),
        ws.stride(0),
        c.stride(0),
        c.stride(1),
        BS_E8M0=e8m0,
        A_BF16=x_fp8.dtype == torch.bfloat16,
        F32_MATH=x_fp8.device.type == "cpu",  # the Triton interpreter (CPU tests)
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=bk,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        return sum_splits(c, out_dtype)  # fixed-order reduction: deterministic, M-independent
    return c[0]


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    batch_invariant: bool = False,
    config: GemmConfig | DecodeConfig,
) -> torch.Tensor:
    """x [..., K] -> [..., N] x.dtype: the activations quantised per 32 and expanded to bf16 in one
    pass (`act_fake_quant_bf16`: the same bf16 operand the GEMM would build from x_fp8 and its
    scales per tile), so each tile only expands the weight; then `fp8_gemm` with `config`.
    Results are bitwise those of `fp8_gemm` on (x_fp8, x_scale)."""
    from .quant import act_fake_quant_bf16

    x2 = x.reshape(-1, x.shape[-1])
    xa = act_fake_quant_bf16(x2)
    y = fp8_gemm(xa, xa, w, w_scale, x.dtype, batch_invariant=batch_invariant, config=config)
    return y.reshape(*x.shape[:-1], w.shape[0])
