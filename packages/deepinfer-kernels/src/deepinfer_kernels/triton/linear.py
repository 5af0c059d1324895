"""Triton FP8 block-scaled GEMM: per-32 FP8 activations x 32x32-block FP8 weights, fp32 accumulate.

Scales change every 32 along K, so the K loop runs FP8 tensor-core dots of depth 32 and promotes
each partial product into the fp32 accumulator with its scale ``sa[m] * sb[n // 32]`` (exact
powers of two), the way DeepGEMM promotes per 128. A second mode (`DEQUANT_BF16`) expands both
operands exactly to bf16 (e4m3 x 2**e fits bf16) and runs bf16 dots of any depth instead.

Tile choice depends on M unless the registry is in batch-invariant mode; then one configuration
(no split-K) serves every M, so a row's result never depends on the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import e8m0_to_fp32


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    dequant_bf16: bool = False
    group_m: int = 8


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
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cs,
    stride_cm,
    BS_E8M0: tl.constexpr,
    DEQUANT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
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
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)  # clamped: loads need no row mask
    rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_chunk
    k_end = tl.minimum(K, k_begin + k_chunk)
    KG: tl.constexpr = BLOCK_K // 32

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if DEQUANT_BF16:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < k_end
            a = tl.load(
                a_ptr + rows_a[:, None] * stride_am + offs_k[None, :],
                mask=kmask[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :],
                mask=kmask[None, :],
                other=0.0,
            )
            gk = k0 // 32 + tl.arange(0, KG)
            gmask = gk * 32 < k_end
            sa = tl.load(
                as_ptr + rows_a[:, None] * stride_asm + gk[None, :], mask=gmask[None, :], other=0.0
            )
            sbr = tl.load(
                bs_ptr + (rows_b // 32)[:, None] * stride_bsn + gk[None, :],
                mask=gmask[None, :],
                other=0,
            )
            if BS_E8M0:
                sb = e8m0_to_fp32(sbr)
            else:
                sb = sbr
            a3 = tl.reshape(a.to(tl.float32), (BLOCK_M, KG, 32)) * sa[:, :, None]
            b3 = tl.reshape(b.to(tl.float32), (BLOCK_N, KG, 32)) * sb[:, :, None]
            a16 = tl.reshape(a3, (BLOCK_M, BLOCK_K)).to(tl.bfloat16)
            b16 = tl.reshape(b3, (BLOCK_N, BLOCK_K)).to(tl.bfloat16)
            acc = tl.dot(a16, tl.trans(b16), acc)
        else:
            for s in tl.static_range(KG):
                offs_k = k0 + s * 32 + tl.arange(0, 32)
                kmask = offs_k < k_end
                a = tl.load(
                    a_ptr + rows_a[:, None] * stride_am + offs_k[None, :],
                    mask=kmask[None, :],
                    other=0.0,
                )
                b = tl.load(
                    b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :],
                    mask=kmask[None, :],
                    other=0.0,
                )
                g = k0 // 32 + s
                gvalid = g * 32 < k_end
                sa = tl.load(as_ptr + rows_a * stride_asm + g, mask=gvalid, other=0.0)
                sbr = tl.load(bs_ptr + (rows_b // 32) * stride_bsn + g, mask=gvalid, other=0)
                if BS_E8M0:
                    sb = e8m0_to_fp32(sbr)
                else:
                    sb = sbr
                part = tl.dot(a, tl.trans(b))
                acc += part * (sa[:, None] * sb[None, :])

    c_rows = offs_m.to(tl.int64)
    c_ptrs = c_ptr + pid_k * stride_cs + c_rows[:, None] * stride_cm + offs_n[None, :]
    cmask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=cmask)


# One configuration for every M in batch-invariant mode (depth-32 promotion, no split).
INVARIANT = GemmConfig(64, 128, 128, 1, 4, 4)


def pick_config(m: int, n: int, k: int, batch_invariant: bool, num_sms: int = 132) -> GemmConfig:
    """Tile shapes by M bucket; decode shapes add split-K until the grid fills the chip."""
    if batch_invariant:
        return INVARIANT
    if m <= 16:
        bm, bn, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        bm, bn, warps, stages = 64, 64, 4, 4
    elif m <= 256:
        bm, bn, warps, stages = 64, 128, 4, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    while tiles * split * 2 <= 2 * num_sms and k // (split * 2) >= 512:
        split *= 2
    return GemmConfig(bm, bn, 128, split, warps, stages)


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    batch_invariant: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """[M, K] e4m3 (+ [M, K/32] fp32 scales) x [N, K] e4m3 (+ [N/32, K/32] e8m0) -> [M, N]."""
    m, k = x_fp8.shape
    n = w.shape[0]
    x_fp8, x_scale, w = x_fp8.contiguous(), x_scale.contiguous(), w.contiguous()
    e8m0 = w_scale.dtype == torch.float8_e8m0fnu
    ws = (w_scale.view(torch.uint8) if e8m0 else w_scale.float()).contiguous()
    cfg = config or pick_config(m, n, k, batch_invariant)
    if m == 0:
        return torch.empty(0, n, dtype=out_dtype, device=x_fp8.device)
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
        x_fp8.stride(0),
        x_scale.stride(0),
        w.stride(0),
        ws.stride(0),
        c.stride(0),
        c.stride(1),
        BS_E8M0=e8m0,
        DEQUANT_BF16=cfg.dequant_bf16,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        return c.sum(0).to(out_dtype)  # fixed-order reduction: deterministic run to run
    return c[0]


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, batch_invariant: bool = False
) -> torch.Tensor:
    """x [..., K] -> [..., N] x.dtype: Triton per-32 act quant, then the FP8 GEMM."""
    from .quant import act_quant_fp8

    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = act_quant_fp8(x2)
    y = fp8_gemm(xq, xs, w, w_scale, x.dtype, batch_invariant=batch_invariant)
    return y.reshape(*x.shape[:-1], w.shape[0])
