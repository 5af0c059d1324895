"""Decode-shaped FP8 GEMMs of the Triton tier (few activation rows): a weight-streaming kernel with
a fixed split of K, a CUDA-core GEMV, and the fixed-order sum of split partials.

At M <= 64 the op reads 32x32-block FP8 weights [N, K] once and does little arithmetic per byte,
so the kernels are built to stream the weight:
- `_decode_gemm_kernel`: each program owns `block_n` output features and a fixed slice of K,
  loads the weight in full `block_k`-wide rows (no masks along K, so the loads stay cp.async
  vectors) and keeps the few activation rows of the tile in registers. 64 weight rows fill the
  wgmma's M and are expanded ``e4m3 * 2**e`` exactly to bf16 (the tiled kernel's expansion);
  the activation rows are the MMA's N (`block_m`, 16 or 64).
- `_gemv_kernel` (M <= GEMV_MAX_M): no MMA; each program loads a tile of weight rows in one
  piece and does fp32 FMAs on CUDA cores (`gemv_config`: the whole of K per program, one
  kernel). Its fp32 sums run in another order than the wgmma kernels', so batch-invariant mode
  never takes it.

The decode kernel forms exactly the products the tiled kernel (`linear._fp8_gemm_kernel`) forms
and runs on wgmma, whose rows do not depend on the tile: with the same split of K the two give a
row the same bits (the GPU tests check it across M). The split count comes from N and K only
(`decode_split`), never from M, and the partials are added by `sum_splits` in a fixed order:
batch-invariant by construction. Which kernel takes a call is decided in `ops/linear.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import dot_exact, e8m0_to_fp32, fp8_to_bf16_scaled

NUM_SMS = 132
"""H200 multiprocessors: the split policy's target. A constant, not read from the device, so the
split (and therefore every row's bits) is a function of (N, K) alone."""


@dataclass(frozen=True)
class DecodeConfig:
    """One decode-kernel configuration. `split_k` of 0 means `decode_split(N, K)` (invariant).
    cuda_core: `_gemv_kernel` (M <= GEMV_MAX_M), block_k is then the K chunk, or all of K in one
    program with split_k=1; prefetch: (cuda_core) the program's weight tile into L2 first."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4
    cuda_core: bool = False
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.cuda_core and 32 % self.block_n:
            raise ValueError(
                f"DecodeConfig.cuda_core needs block_n dividing 32, got block_n={self.block_n}"
            )
        if self.cuda_core and self.block_k & (self.block_k - 1):
            raise ValueError(f"DecodeConfig.block_k must be a power of two, got {self.block_k}")
        if not self.cuda_core and self.block_n % 32:
            raise ValueError(f"DecodeConfig.block_n must be a multiple of 32, got {self.block_n}")
        if self.block_k % 32 or self.block_k < 32:
            raise ValueError(f"DecodeConfig.block_k must be a multiple of 32, got {self.block_k}")


def decode_split(n: int, k: int, batch_invariant: bool = True) -> int:
    """Split count of K for an [N, K] weight: a function of N and K (and the mode), never of M.

    Doubles from 1 while there are fewer 64-row weight tiles x splits than 2 (invariant mode) or
    4 (auto) programs per SM of `NUM_SMS`, a split keeps >= 1024 columns of K, and K/32 stays
    divisible by the count (so splits start on scale groups and every kernel cuts K at the same
    places: K/split each). Invariant mode aims lower because prefill GEMMs split K the same way
    in that mode, and each split there costs an fp32 partial of the whole output."""
    tiles = triton.cdiv(n, 64)
    target = (2 if batch_invariant else 4) * NUM_SMS
    s = 1
    while tiles * s < target and (k // 32) % (2 * s) == 0 and k // (2 * s) >= 1024:
        s *= 2
    return s


GEMV_MAX_M = 4
"""Most activation rows `_gemv_kernel` takes (it does one FMA per weight value per row)."""


def gemv_config(n: int, k: int) -> DecodeConfig:
    """The CUDA-core kernel over the whole of K per program (no partials, one kernel), with rows
    per program a function of (N, K): about 16 KB of weight per program, at most 4 rows, halved
    while there would be fewer than 4 programs per SM (smaller tiles: more programs resident,
    more bytes in flight)."""
    k_pad = triton.next_power_of_2(k)
    if k_pad > 32768:  # more than 256 B of weight per thread: 8192-wide chunks and partials
        return DecodeConfig(block_n=4, block_k=8192, cuda_core=True)
    rows = max(1, min(4, 16384 // k_pad))
    rows = 1 << (rows.bit_length() - 1)
    while rows > 1 and triton.cdiv(n, rows) < 4 * NUM_SMS:
        rows //= 2
    return DecodeConfig(block_n=rows, split_k=1, cuda_core=True)


def pick_block_k(chunk: int, want: int) -> int:
    """The largest of want, want/2, ..., 32 that divides the K chunk (K steps then need no mask)."""
    bk = want
    while chunk % bk:
        bk //= 2
    return bk


@triton.jit(do_not_specialize=["M"])  # one compile for every M
def _decode_gemm_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    c_ptr,
    M,
    N,
    k_chunk,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_cs,
    stride_cm,
    A_BF16: tl.constexpr,
    WS_E8M0: tl.constexpr,
    F32_MATH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[s, m, n] = sum over K slice s of x_hat[m, k] * w_hat[n, k] (fp32, one wgmma chain).

    a: x_fp8 [M, K] e4m3 with as [M, K/32] fp32 scales, or (A_BF16) x_hat [M, K] bf16 already
    expanded. w [N, K] e4m3 with ws [ceil(N/32), K/32] (e8m0 bytes or fp32). k_chunk is a
    multiple of BLOCK_K and the K slices tile K exactly, so no load is masked along K. Grid
    (M tiles, N tiles, splits): the M tiles of one weight tile are adjacent, so extra M tiles
    hit L2. F32_MATH (CPU tensors: only the Triton interpreter runs those) computes the same
    exact values in fp32 (the interpreter's bf16 arithmetic is wrong).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # clamped rows: padded activation rows repeat row 0 and padded weight rows repeat row 0, so no
    # load needs a mask; their results are never stored
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_w = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    KG: tl.constexpr = BLOCK_K // 32
    k_begin = pid_s * k_chunk
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, KG)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + (k_begin + offs_k)[None, :]
    as_ptrs = as_ptr + rows_a[:, None] * stride_asm + (k_begin // 32 + offs_g)[None, :]
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + (k_begin + offs_k)[None, :]
    ws_ptrs = ws_ptr + (rows_w // 32)[:, None] * stride_wsn + (k_begin // 32 + offs_g)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, k_chunk, BLOCK_K):
        w = tl.load(w_ptrs)
        a = tl.load(a_ptrs)
        sw = tl.load(ws_ptrs)
        if WS_E8M0:
            sw = e8m0_to_fp32(sw)
        # x_hat = x_fp8 * 2**e, exact in bf16 (the same expansion as the tiled kernel)
        if A_BF16:
            a16 = a
        else:
            sa = tl.load(as_ptrs)
            a16 = fp8_to_bf16_scaled(a, sa, BLOCK_M, BLOCK_K, KG, F32_MATH)
        w16 = fp8_to_bf16_scaled(w, sw, BLOCK_N, BLOCK_K, KG, F32_MATH)
        acc = dot_exact(w16, tl.trans(a16), acc, F32_MATH)
        a_ptrs += BLOCK_K
        as_ptrs += KG
        w_ptrs += BLOCK_K
        ws_ptrs += KG
    acc = tl.trans(acc)
    c_ptrs = c_ptr + pid_s * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    cmask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of each address (GPU only); the int32 result is a dummy."""
    return tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\nmov.u32 $0, 0;",
        "=r,l",
        [ptrs.to(tl.int64, bitcast=True)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    c_ptr,
    M,
    N,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_cs,
    stride_cm,
    groups,
    A_BF16: tl.constexpr,
    WS_E8M0: tl.constexpr,
    ROWS_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
    MASK_G: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """CUDA-core GEMV: c[s, m, n] = sum over the K chunk s of x_hat[m, k] * w_hat[n, k], fp32 FMA.

    One program: BLOCK_N weight rows (inside one 32-row scale block) x `groups` 32-column groups of
    K (G, a power of two, padded; MASK_G masks groups >= `groups`, e.g. the whole of K = 7168 in
    one program: 224 of 256), loaded as one tile: no K loop, no pipeline wait, no barrier in the
    stream. ptxas issues the tile's 16-byte loads in batches between conversions (one memory
    latency per batch, SASS sm_90), so PREFETCH first sends every 128-byte line of the tile to L2
    (fire and forget, no registers): the whole tile is in flight at once. Each 32-column group's
    products w_fp8 * x (x: x_fp8 or the bf16 x_hat, 4 significant bits) are exact in fp32 and
    summed in fp32; the group's power-of-two scale (w_scale, times x_scale for x_fp8) multiplies
    that sum exactly; the groups' sums add in a fixed order per (N, K, groups).
    ROWS_M activation rows (M <= ROWS_M, a small constant) each reuse the converted weight tile.
    Per weight byte: e4m3x2 -> f16x2 (0.5), f16 -> f32 (1), one FMA per activation row.
    """
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_w = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    g_begin = pid_s * groups
    k_begin = g_begin * 32
    offs_g = tl.arange(0, G)
    gmask = offs_g < groups
    # [G, 32] offsets of the chunk: the 32 columns of a scale group along the last axis, so the
    # scales apply to per-group partial sums (3D tiles keep every operand in one layout family)
    offs_gk = offs_g[:, None] * 32 + tl.arange(0, 32)[None, :]
    if PREFETCH:
        # every 128-byte line of the tile into L2 first: fire-and-forget, no registers, so the
        # whole tile is in flight at once (ptxas issues the tile's 16-byte loads in batches
        # between conversions, one memory latency per batch; those loads then hit L2)
        lines = tl.arange(0, G // 4)
        line_ptrs = w_ptr + rows_w[:, None] * stride_wn + (k_begin + lines * 128)[None, :]
        if MASK_G:
            line_ptrs = tl.where((lines < groups // 4)[None, :], line_ptrs, line_ptrs - lines * 128)
        _prefetch_l2(line_ptrs)
    w_ptrs = w_ptr + rows_w[:, None, None] * stride_wn + (k_begin + offs_gk)[None, :, :]
    sw_ptrs = ws_ptr + (pid_n * BLOCK_N // 32) * stride_wsn + g_begin + offs_g
    if MASK_G:
        w = tl.load(w_ptrs, mask=gmask[None, :, None], other=0.0)
        sw = tl.load(sw_ptrs, mask=gmask, other=0)
    else:
        w = tl.load(w_ptrs)
        sw = tl.load(sw_ptrs)
    if WS_E8M0:
        sw = e8m0_to_fp32(sw)
    wf = w.to(tl.float32)
    cmask = offs_n < N
    for m in tl.static_range(ROWS_M):
        ok = m < M
        mrow = tl.where(ok, m, 0).to(tl.int64)
        x_ptrs = a_ptr + mrow * stride_am + k_begin + offs_gk
        xs_ptrs = as_ptr + mrow * stride_asm + g_begin + offs_g
        # the activation row is small next to the tile: always masked (all true unless MASK_G)
        x = tl.load(x_ptrs, mask=gmask[:, None], other=0.0).to(tl.float32)
        s = sw
        if not A_BF16:
            s = tl.load(xs_ptrs, mask=gmask, other=0.0) * sw
        # exact products, fp32 sums per 32-column group, then the group's power-of-two scale
        # (exact) and the sum over groups
        part = tl.sum(wf * x[None, :, :], axis=2)
        acc = tl.sum(part * s[None, :], axis=1)
        c_ptrs = c_ptr + pid_s * stride_cs + mrow * stride_cm + offs_n
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=cmask & ok)


@triton.jit
def _sum_splits_kernel(p_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = ((p[0, i] + p[1, i]) + p[2, i]) + ...: a fixed order, whoever wrote first."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """partials [S, M, N] fp32 -> [M, N] out_dtype, summed over S in ascending order."""
    s, m, n = partials.shape
    out = torch.empty(m, n, dtype=out_dtype, device=partials.device)
    numel = m * n
    if numel:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(numel, block),)](
            partials, out, numel, SPLITS=s, BLOCK=block, num_warps=4
        )
    return out


def _gemv(x, x_scale, w, w_scale, out_dtype, cfg: DecodeConfig) -> torch.Tensor:
    """`decode_gemm` on `_gemv_kernel`: K cut into chunks of the largest power of two <= block_k
    that divides K (a function of K alone), one program per (block_n rows, chunk), the chunks'
    partials summed by `sum_splits`; or (split_k == 1) one program per block_n rows over the whole
    of K, writing the output directly (one kernel)."""
    m, k = x.shape
    n = w.shape[0]
    if m > GEMV_MAX_M:
        raise ValueError(f"decode_gemm: DecodeConfig.cuda_core takes M <= {GEMV_MAX_M}, got {m}")
    if cfg.split_k == 1:  # the whole of K in one program: no partials, no second kernel
        chunk, split = k, 1
    else:
        chunk = pick_block_k(k, cfg.block_k)
        split = k // chunk
    groups = chunk // 32
    g_pad = triton.next_power_of_2(groups)
    a_bf16 = x.dtype == torch.bfloat16
    x, w = x.contiguous(), w.contiguous()
    xs = x if a_bf16 else x_scale.contiguous()
    e8m0 = w_scale.dtype == torch.float8_e8m0fnu
    ws = (w_scale.view(torch.uint8) if e8m0 else w_scale.float()).contiguous()
    if m == 0:
        return torch.empty(0, n, dtype=out_dtype, device=x.device)
    if split > 1:
        c = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        c = torch.empty(1, m, n, dtype=out_dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x,
        xs,
        w,
        ws,
        c,
        m,
        n,
        x.stride(0),
        xs.stride(0),
        w.stride(0),
        ws.stride(0),
        c.stride(0),
        c.stride(1),
        groups,
        A_BF16=a_bf16,
        WS_E8M0=e8m0,
        ROWS_M=m,
        BLOCK_N=cfg.block_n,
        G=g_pad,
        MASK_G=g_pad != groups,
        PREFETCH=cfg.prefetch and x.device.type == "cuda" and g_pad >= 4,
        num_warps=cfg.num_warps,
        num_stages=1,
    )
    if split > 1:
        return sum_splits(c, out_dtype)
    return c[0]


def decode_gemm(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """[M, K] activations x [N, K] e4m3 weight -> [M, N] out_dtype, fp32 accumulation.

    x is x_fp8 [M, K] e4m3 with x_scale [M, K/32] fp32 powers of two, or x_hat [M, K] bf16 already
    expanded (then x_scale is ignored); w_scale [ceil(N/32), K/32] e8m0 or fp32 powers of two.
    Row results do not depend on M (see the module docstring).
    """
    cfg = config or DecodeConfig()
    m, k = x.shape
    n = w.shape[0]
    if k % 32:
        raise ValueError(f"decode_gemm: K must be a multiple of 32, got {k}")
    if cfg.cuda_core:
        return _gemv(x, x_scale, w, w_scale, out_dtype, cfg)
    split = cfg.split_k or decode_split(n, k)
    if (k // 32) % split:
        raise ValueError(f"decode_gemm: split_k={split} must divide K/32={k // 32}")
    chunk = k // split
    bk = pick_block_k(chunk, cfg.block_k)
    a_bf16 = x.dtype == torch.bfloat16
    x, w = x.contiguous(), w.contiguous()
    xs = x if a_bf16 else x_scale.contiguous()
    e8m0 = w_scale.dtype == torch.float8_e8m0fnu
    ws = (w_scale.view(torch.uint8) if e8m0 else w_scale.float()).contiguous()
    if m == 0:
        return torch.empty(0, n, dtype=out_dtype, device=x.device)
    if split > 1:
        c = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        c = torch.empty(1, m, n, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    _decode_gemm_kernel[grid](
        x,
        xs,
        w,
        ws,
        c,
        m,
        n,
        chunk,
        x.stride(0),
        xs.stride(0),
        w.stride(0),
        ws.stride(0),
        c.stride(0),
        c.stride(1),
        A_BF16=a_bf16,
        WS_E8M0=e8m0,
        F32_MATH=x.device.type == "cpu",
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=bk,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        return sum_splits(c, out_dtype)
    return c[0]
