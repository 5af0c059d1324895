"""Triton FP8 block-scaled GEMM: per-32 FP8 activations x 32x32-block FP8 weights, fp32 accumulate.

Scales change every 32 along K, so the K loop steps 32 at a time. The default mode
(`DEQUANT_BF16`) expands both operands exactly to bf16 in registers (e4m3 x 2**e is a bf16 value)
and chains bf16 tensor-core dots into one fp32 accumulator: the same sum of exact products as the
reference, in another order. The other mode runs FP8 tensor-core dots of depth 32 and promotes
each into the fp32 accumulator with ``sa[m] * sb[n // 32]``, as DeepGEMM promotes per 128; under
Triton its loads are not software-pipelined and it spills at 128x128 tiles, so it is a variant
kept for measurement.

Decode shapes (M <= DECODE_MAX_M) go to the weight-streaming kernel of `gemv.py`. Above that the
tile choice depends on M. In batch-invariant mode K is split exactly as the decode kernel splits it
(a function of N and K only) and only wgmma tiles are used, which give a row the same bits whatever
the tile (see `pick_config`), so a row's result never depends on the other rows; the GPU tests
check this bitwise.

On Hopper with tilelang, `tilelang_route` sends auto-mode calls with 2 <= M <= 64 and every
batch-invariant call to the TileLang swap-AB decode kernel (`tilelang/decode_gemm.py`) when it
takes the shape (K a multiple of 128; FP8 activations): the Triton kernels then serve M=1 in auto
mode (CUDA-core GEMV), the prefill sizes in auto mode, and the shapes TileLang cannot take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import dot_exact, e8m0_to_fp32, fp8_to_bf16_scaled
from .gemv import (
    GEMV_AUTO_MAX_M,
    DecodeConfig,
    decode_gemm,
    decode_split,
    gemv_config,
    sum_splits,
)


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
    block_k: int = 32  # K per step (a multiple of 32; 32 for the FP8-dot mode)


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
    DEQUANT_BF16: tl.constexpr,
    SWAP_AB: tl.constexpr,
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

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
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
        if DEQUANT_BF16:
            # e4m3 x 2**e is exact in bf16: one accumulator chain, no promotion step
            if A_BF16:  # activations already expanded exactly to bf16 (x_fp8 * scale)
                a16 = a
            else:
                sa = tl.load(as_ptrs, mask=((k0 + offs_g * 32) < k_end)[None, :], other=0.0)
                a16 = fp8_to_bf16_scaled(a, sa, BLOCK_M, BLOCK_K, KG, F32_MATH)
            b16 = fp8_to_bf16_scaled(b, sb, BLOCK_N, BLOCK_K, KG, F32_MATH)
            if SWAP_AB:
                acc = dot_exact(b16, tl.trans(a16), acc, F32_MATH)
            else:
                acc = dot_exact(a16, tl.trans(b16), acc, F32_MATH)
        else:  # BLOCK_K == 32: FP8 dot, promoted with its two scales
            sa = tl.load(as_ptrs)
            part = tl.dot(a, tl.trans(b))
            acc += part * (
                tl.reshape(sa, (BLOCK_M,))[:, None] * tl.reshape(sb, (BLOCK_N,))[None, :]
            )
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        as_ptrs += KG
        bs_ptrs += KG

    if SWAP_AB:
        acc = tl.trans(acc)
    c_rows = offs_m.to(tl.int64)
    c_ptrs = c_ptr + pid_k * stride_cs + c_rows[:, None] * stride_cm + offs_n[None, :]
    cmask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=cmask)


DECODE_MAX_M = 64
"""Calls with at most this many rows take the weight-streaming decode kernel (`gemv.py`). Above,
the tiled kernel is faster (M=128: 77 us graph-replayed against 89 us, 5120x8192, H200)."""

TILELANG_DECODE_M = (2, 64)
"""Auto mode sends calls with lo <= M <= hi rows to the TileLang swap-AB decode kernel
(`tilelang/decode_gemm.py`) where it can run them (Hopper, tilelang importable, K a multiple of
128: `tilelang_decode_reason`). Measured on the H200 (5120x8192, 16 calls in one graph): M=16
16.3 us, M=64 24.7 us, against 28.0 / 48 for the Triton swap kernel; M=1 stays on the CUDA-core
GEMV (15.7 us against 16.3; but at 32768x1280 the GEMV takes 19.1 us and the TileLang kernel 15.3,
and at 2112x7168 8.4 against 10.3: a K-dependent M=1 route is not made, not GPU-tested)."""

TILELANG_INVARIANT = True
"""Batch-invariant mode sends every call the TileLang decode kernel can run to it, whatever M
(its rows do not depend on M: the K split comes from (N, K), token tiles of 16/32/64 give the
same bits, GPU-tested), so a row's bits are the same at M=1 and at M=8192; shapes it cannot run
stay on the Triton kernels, whose invariant split matches among themselves. With
`cuda.fp8_gemm.INVARIANT_PREFILL` on, the registry sends M > `cuda.decode_gemm.MAX_M` to the cuda
tier's prefill kernel instead, which cuts K the same way (`invariant_config`); with only
`tilelang.fp8_gemm.INVARIANT_PREFILL`, to the TileLang prefill kernel (the same split, slower)."""


def tilelang_route(m: int, batch_invariant: bool) -> bool:
    """Whether a call of M rows in this mode goes to the TileLang decode kernel when it can run
    there (before any device or shape check)."""
    if batch_invariant:
        return TILELANG_INVARIANT
    lo, hi = TILELANG_DECODE_M
    return lo <= m <= hi


def tilelang_decode_reason(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> str | None:
    """Why the TileLang decode kernel cannot run this call here (device, library, shape), or
    None. Cheap after the first call (the capability and the import check are cached)."""
    if x_fp8.device.type != "cuda":
        return f"input on {x_fp8.device.type}"
    if not _hopper_with_tilelang(x_fp8.device.index or 0):
        return "needs sm_90a and tilelang"
    from ..tilelang.decode_gemm import shape_reason

    return shape_reason(x_fp8, x_scale, w, w_scale)


_HOPPER_TILELANG: dict[int, bool] = {}


def _hopper_with_tilelang(device: int) -> bool:
    ok = _HOPPER_TILELANG.get(device)
    if ok is None:
        import importlib.util

        ok = torch.cuda.get_device_capability(device) == (9, 0) and (
            importlib.util.find_spec("tilelang") is not None
        )
        _HOPPER_TILELANG[device] = ok
    return ok


def pick_config(
    m: int,
    n: int,
    k: int,
    batch_invariant: bool,
    a_bf16: bool = False,
    num_sms: int = 132,
    tilelang_decode: bool = False,
):
    """Decode shapes (M <= DECODE_MAX_M) take the weight-streaming kernel of `gemv.py`, whose
    split of K depends on (N, K) only; in auto mode M <= GEMV_AUTO_MAX_M takes its CUDA-core GEMV
    instead (`gemv.gemv_config`). With `tilelang_decode` (the caller found that `tilelang_route`
    picks the call, auto mode: M in TILELANG_DECODE_M, invariant mode: every M while
    TILELANG_INVARIANT, and that the TileLang kernel can run it: `tilelang_decode_reason`) the
    call takes the TileLang swap-AB kernel instead (a `tilelang.decode_gemm.DecodeTileConfig`).
    Larger M: tile shapes by M bucket; in auto mode, M <= 256 adds split-K until there are ~4
    CTAs per SM.

    Every configuration expands the FP8 operands exactly to bf16 and runs on wgmma: on Triton
    the depth-32 FP8 dots with per-step promotion neither pipeline their loads nor fit in
    registers, so they are kept only as a variant. Measured on the H200 (`tools/bench_kernels.py
    --only probe`): wgmma tiles of any shape, swapped or not, with any K step, give bitwise the same
    rows for the same split of K; the mma.sync path (16-row tiles without the swap) does not, so it
    is never chosen. Batch-invariant mode therefore splits K exactly as the decode kernel does
    (`decode_split(N, K)`, K/split per slice, fixed-order sum), so a row's bits do not depend on M
    across the decode/prefill boundary either.
    """
    if tilelang_decode:
        from ..tilelang.decode_gemm import pick_tile_config

        return pick_tile_config(m, n, k)
    if m <= GEMV_AUTO_MAX_M and not batch_invariant:
        return gemv_config(n, k)  # CUDA-core GEMV, one kernel (not bitwise with the others)
    if m <= DECODE_MAX_M:
        # swap-AB bf16 tiles, activation rows padded to 16 or 64 (the wgmma's N; the two
        # measured and GPU-tested tiles), 128 K a step
        bm = 16 if m <= 16 else 64
        return DecodeConfig(block_m=bm, split_k=decode_split(n, k, batch_invariant))
    bk = 32
    if m <= 256:
        bm, bn, warps, stages = 64, 128, 4, 5
    else:  # with bf16 activations a 64-deep step pays (417 vs 395 TFLOP/s measured at 8192^2)
        bm, bn, warps, stages, bk = 128, 128, 8, 4, (64 if a_bf16 else 32)
    if batch_invariant:
        return GemmConfig(bm, bn, decode_split(n, k, True), warps, stages, True, block_k=bk)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    while m <= 256 and tiles * split < 4 * num_sms and k // (split * 2) >= 512:
        split *= 2
    return GemmConfig(bm, bn, split, warps, stages, True, block_k=bk)


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    batch_invariant: bool = False,
    config: GemmConfig | DecodeConfig | None = None,
) -> torch.Tensor:
    """[M, K] e4m3 (+ [M, K/32] fp32 scales) x [N, K] e4m3 (+ [N/32, K/32] e8m0) -> [M, N].

    x_fp8 may instead be bf16 activations already expanded (x_fp8 * scale, see `fp8_linear`);
    x_scale is then ignored. In batch-invariant mode the split of K is `decode_split(N, K)` (or
    the config's, which must then divide K/32) and the slices are K/split each.
    """
    m, k = x_fp8.shape
    n = w.shape[0]
    # each check once: the route, then (only if routed) whether the TileLang kernel takes the
    # operands, which its launch then does not ask again
    tilelang = (
        config is None
        and tilelang_route(m, batch_invariant)
        and tilelang_decode_reason(x_fp8, x_scale, w, w_scale) is None
    )
    cfg = config or pick_config(
        m, n, k, batch_invariant, x_fp8.dtype == torch.bfloat16, tilelang_decode=tilelang
    )
    if not isinstance(cfg, (GemmConfig, DecodeConfig)):  # tilelang.decode_gemm.DecodeTileConfig
        from ..tilelang import decode_gemm as tl_decode

        # a caller's config: decode_gemm checks the operands (routed calls passed the check above)
        return tl_decode.decode_gemm(
            x_fp8, x_scale, w, w_scale, out_dtype, cfg, shapes_checked=tilelang
        )
    if isinstance(cfg, DecodeConfig):
        return decode_gemm(x_fp8, x_scale, w, w_scale, out_dtype, cfg)
    x_fp8, x_scale, w = x_fp8.contiguous(), x_scale.contiguous(), w.contiguous()
    e8m0 = w_scale.dtype == torch.float8_e8m0fnu
    ws = (w_scale.view(torch.uint8) if e8m0 else w_scale.float()).contiguous()
    if m == 0:
        return torch.empty(0, n, dtype=out_dtype, device=x_fp8.device)
    bk = cfg.block_k if cfg.dequant_bf16 else 32
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
        DEQUANT_BF16=cfg.dequant_bf16,
        SWAP_AB=cfg.swap_ab and cfg.dequant_bf16,
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
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, batch_invariant: bool = False
) -> torch.Tensor:
    """x [..., K] -> [..., N] x.dtype: Triton per-32 act quant, then the FP8 GEMM.

    The activations are quantised and expanded to bf16 in one pass (`act_fake_quant_bf16`: the
    same bf16 operand the GEMM would build from x_fp8 and its scales per tile), so each tile only
    expands the weight; results are bitwise those of `fp8_gemm` on (x_fp8, x_scale).
    """
    from .quant import act_fake_quant_bf16, act_quant_fp8

    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    if x.is_cuda and tilelang_route(m, batch_invariant):
        # the TileLang decode kernel takes FP8 activations: quantise, then check them once
        xq, xs = act_quant_fp8(x2)
        if tilelang_decode_reason(xq, xs, w, w_scale) is None:
            from ..tilelang import decode_gemm as tl_decode

            y = tl_decode.decode_gemm(xq, xs, w, w_scale, x.dtype, shapes_checked=True)
            return y.reshape(*x.shape[:-1], w.shape[0])
    cfg = pick_config(m, w.shape[0], k, batch_invariant, a_bf16=True)
    if isinstance(cfg, DecodeConfig) and cfg.mma_fp8:  # FP8 dots take the FP8 activations
        xq, xs = act_quant_fp8(x2)
        y = fp8_gemm(xq, xs, w, w_scale, x.dtype, batch_invariant=batch_invariant, config=cfg)
    else:
        xa = act_fake_quant_bf16(x2)
        y = fp8_gemm(xa, xa, w, w_scale, x.dtype, batch_invariant=batch_invariant, config=cfg)
    return y.reshape(*x.shape[:-1], w.shape[0])
