"""Triton FP8 block-scaled GEMM: per-32 FP8 activations x 32x32-block FP8 weights, fp32 accumulate.

Scales change every 32 along K, so the K loop steps 32 at a time. The default mode
(`DEQUANT_BF16`) expands both operands exactly to bf16 in registers (e4m3 x 2**e is a bf16 value)
and chains bf16 tensor-core dots into one fp32 accumulator: the same sum of exact products as the
reference, in another order. The other mode runs FP8 tensor-core dots of depth 32 and promotes
each into the fp32 accumulator with ``sa[m] * sb[n // 32]``, as DeepGEMM promotes per 128; under
Triton its loads are not software-pipelined and it spills at 128x128 tiles, so it is a variant
kept for measurement.

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
    split_k: int
    num_warps: int
    num_stages: int
    dequant_bf16: bool = False
    group_m: int = 8
    swap_ab: bool = False  # compute C^T = W X^T: weight rows fill the MMA's M (small-M decode)


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
    SWAP_AB: tl.constexpr,
    A_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)  # clamped rows: loads need no mask
    rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    # K is a multiple of 32 (one scale group per step), so no step needs a K mask either
    k_chunk = tl.cdiv(K // 32, SPLIT_K) * 32
    k_begin = pid_k * k_chunk
    k_end = tl.minimum(K, k_begin + k_chunk)
    offs_k = tl.arange(0, 32)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + (k_begin + offs_k)[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + (k_begin + offs_k)[None, :]
    as_ptrs = as_ptr + rows_a * stride_asm + k_begin // 32
    bs_ptrs = bs_ptr + (rows_b // 32) * stride_bsn + k_begin // 32

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(k_begin, k_end, 32):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        sa = tl.load(as_ptrs)
        sb = tl.load(bs_ptrs)
        if BS_E8M0:
            sb = e8m0_to_fp32(sb)
        if DEQUANT_BF16:
            # e4m3 x 2**e is exact in bf16: one accumulator chain, no promotion step
            if A_BF16:  # activations already expanded exactly to bf16 (x_fp8 * scale)
                a16 = a
            else:
                a16 = (a.to(tl.float32) * sa[:, None]).to(tl.bfloat16)
            b16 = (b.to(tl.float32) * sb[:, None]).to(tl.bfloat16)
            if SWAP_AB:
                acc = tl.dot(b16, tl.trans(a16), acc)
            else:
                acc = tl.dot(a16, tl.trans(b16), acc)
        else:
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        a_ptrs += 32
        b_ptrs += 32
        as_ptrs += 1
        bs_ptrs += 1

    if SWAP_AB:
        acc = tl.trans(acc)
    c_rows = offs_m.to(tl.int64)
    c_ptrs = c_ptr + pid_k * stride_cs + c_rows[:, None] * stride_cm + offs_n[None, :]
    cmask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=cmask)


PREFILL_BF16_A_ROWS = 256
"""fp8_linear feeds bf16-expanded activations to the GEMM above this many rows."""

# One configuration for every M in batch-invariant mode (no split-K, same MMA shape).
INVARIANT = GemmConfig(64, 128, 1, 4, 5, dequant_bf16=True)


def pick_config(m: int, n: int, k: int, batch_invariant: bool, num_sms: int = 132) -> GemmConfig:
    """Tile shapes by M bucket; decode shapes add split-K until the grid fills the chip.

    Every configuration expands the FP8 operands exactly to bf16 (`DEQUANT_BF16`): on Triton the
    depth-32 FP8 dots with per-step promotion neither pipeline their loads nor fit in registers
    (see the note in tools/bench_kernels.py's output), so they are kept only as a variant.
    """
    if batch_invariant:
        return INVARIANT
    if m <= 16:
        bm, bn, warps, stages = 16, 128, 4, 6
    elif m <= 64:
        bm, bn, warps, stages = 64, 64, 4, 5
    elif m <= 256:
        bm, bn, warps, stages = 64, 128, 4, 5
    else:
        bm, bn, warps, stages = 128, 128, 8, 4
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    while tiles * split * 2 <= 2 * num_sms and k // (split * 2) >= 512:
        split *= 2
    return GemmConfig(bm, bn, split, warps, stages, dequant_bf16=True)


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
        SWAP_AB=cfg.swap_ab and cfg.dequant_bf16,
        A_BF16=x_fp8.dtype == torch.bfloat16,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
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
    """x [..., K] -> [..., N] x.dtype: Triton per-32 act quant, then the FP8 GEMM.

    Above `PREFILL_BF16_A_ROWS` rows the activations are quantised and expanded to bf16 in one pass
    (the same values the GEMM would expand per tile), so each tile only expands the weight; the
    GEMM's bf16 operands are bitwise the same either way, so batch invariance is unaffected.
    """
    from .quant import act_fake_quant_bf16, act_quant_fp8

    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > PREFILL_BF16_A_ROWS:
        xa = act_fake_quant_bf16(x2)
        y = fp8_gemm(xa, xa, w, w_scale, x.dtype, batch_invariant=batch_invariant)
    else:
        xq, xs = act_quant_fp8(x2)
        y = fp8_gemm(xq, xs, w, w_scale, x.dtype, batch_invariant=batch_invariant)
    return y.reshape(*x.shape[:-1], w.shape[0])
