"""Triton activation quantisation: plain, fused with RMSNorm, fused with clamped SwiGLU x routing
weight. Same numerics as `ref/quant.py` (RMSNorm's rsqrt may differ from torch's in the last bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import ACT_AMAX_FLOOR
from ._common import quant_groups_fp8

# The row-chunked kernels' tile: 4 rows x 1024 columns per program, 8 warps. H200 (NOTES.md,
# eighteenth session), same run: act_quant_fp8 8192 x 5120 37.6 us against 103.5 for one row x
# 256 columns x 4 warps (the former tile), 49152 x 2304 101.4 against 271.6; swiglu 1.3-1.6x;
# the same bits (a row's groups do not depend on the tile). Gathered rows keep one row x 1024
# columns x 4 warps per program (4 rows: 0.8x at 8192 rows); the SwiGLU kernel (two inputs)
# takes 4 rows x 512 x 4 warps (49152 x 2304: 182.5 us against 205.9 for this tile).
# A tile: (rows, columns, warps) per program.
_TILE = (4, 1024, 8)
_GATHER_TILE = (1, 1024, 4)
_SWIGLU_TILE = (4, 512, 4)


def _tile_grid(rows: int, k: int, tile: tuple[int, int, int]) -> tuple[int, int]:
    """The grid of a [rows, k] call on `tile`s."""
    return triton.cdiv(rows, tile[0]), triton.cdiv(k, tile[1])


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    R,
    K,
    FLOOR: tl.constexpr,
    WIDTH: tl.constexpr,
    DEQ_OUT: tl.constexpr,
    rows_ptr=None,
    PERMUTE_K: tl.constexpr = False,
    BLOCK_ROWS: tl.constexpr = 1,
):
    """BLOCK_ROWS rows (of R) x WIDTH columns (of K) per program."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = row < R
    col = tl.program_id(1) * WIDTH + tl.arange(0, WIDTH)
    mask = rmask[:, None] & (col < K)[None, :]
    src = row if rows_ptr is None else tl.load(rows_ptr + row, mask=rmask, other=0).to(tl.int64)
    x = tl.load(x_ptr + src[:, None] * K + col[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s = quant_groups_fp8(x, BLOCK_ROWS, WIDTH, FLOOR)
    at = q_ptr + row[:, None] * K + col[None, :]
    if DEQ_OUT:  # x_fp8 * scale, exact in bf16
        d = tl.reshape(q.to(tl.float32), (BLOCK_ROWS, WIDTH // 32, 32)) * s[:, :, None]
        if PERMUTE_K:  # value 32t + 4s + 2hi + e of each 128 to slot 16s + 8hi + 2t + e
            d = tl.reshape(d, (BLOCK_ROWS, WIDTH // 128, 4, 8, 2, 2))
            d = tl.permute(d, (0, 1, 3, 4, 2, 5))
        tl.store(at, tl.reshape(d, (BLOCK_ROWS, WIDTH)).to(tl.bfloat16), mask=mask)
    else:
        tl.store(at, q, mask=mask)
        g = tl.program_id(1) * (WIDTH // 32) + tl.arange(0, WIDTH // 32)
        smask = rmask[:, None] & (g < K // 32)[None, :]
        tl.store(s_ptr + row[:, None] * (K // 32) + g[None, :], s, mask=smask)


def _outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((*x.shape[:-1], k // 32), dtype=torch.float32, device=x.device)
    return q, s


def act_quant_fp8(x: torch.Tensor, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_fp8 [..., K], scale [..., K/32] fp32)."""
    x = x.contiguous()
    q, s = _outputs(x)
    rows, k = x.numel() // x.shape[-1], x.shape[-1]
    if rows:
        block_rows, width, warps = _TILE
        _act_quant_kernel[_tile_grid(rows, k, _TILE)](
            x, q, s, rows, k, FLOOR=ACT_AMAX_FLOOR, WIDTH=width, DEQ_OUT=False,
            BLOCK_ROWS=block_rows, num_warps=warps,
        )  # fmt: skip
    return q, s


def quantised_linear(
    gemm, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, **gemm_kwargs: object
) -> torch.Tensor:
    """x [..., K] float -> [..., N] x.dtype through an FP8 GEMM tier's `gemm(xq, xs, w, w_scale,
    out_dtype, **gemm_kwargs)`: x quantised per 32 by `act_quant_fp8` first (the quantiser every
    GPU tier's `fp8_linear` uses, so all see the same FP8 operands whatever the overrides)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = act_quant_fp8(x2)
    y = gemm(xq, xs, w, w_scale, x.dtype, **gemm_kwargs)
    return y.reshape(*x.shape[:-1], w.shape[0])


def act_fake_quant_bf16(
    x: torch.Tensor, rows: torch.Tensor | None = None, permute_k: bool = False
) -> torch.Tensor:
    """x [..., K] -> bf16 x_fp8 * scale (the per-32 FP8 quantisation, expanded exactly to bf16):
    the A operand of the prefill GEMM, which then skips expanding activations per tile.

    rows [P] (int, of x [T, K]): the result's rows gathered in the same pass, [P, K]; permute_k:
    its columns in the order `cuda.moe_decode.k_permutation` gives (K a multiple of 128)."""
    x = x.contiguous()
    k = x.shape[-1]
    if permute_k and k % 128:
        raise ValueError(f"act_fake_quant_bf16: permute_k needs K a multiple of 128, got {k}")
    out = torch.empty(x.shape if rows is None else (rows.shape[0], k), dtype=torch.bfloat16,
                      device=x.device)  # fmt: skip
    n = out.numel() // k
    if n:
        tile = _GATHER_TILE if rows is not None else _TILE
        block_rows, width, warps = tile
        _act_quant_kernel[_tile_grid(n, k, tile)](
            x, out, out, n, k, FLOOR=ACT_AMAX_FLOOR, WIDTH=width, DEQ_OUT=True, rows_ptr=rows,
            PERMUTE_K=permute_k, BLOCK_ROWS=block_rows, num_warps=warps,
        )  # fmt: skip
    return out


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, w_ptr, q_ptr, s_ptr, K, eps, FLOOR: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < K
    x = tl.load(x_ptr + row * K + col, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / K
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    y = (w * (xf * tl.math.rsqrt(var + eps))).to(x.dtype).to(tl.float32)
    q, s = quant_groups_fp8(tl.reshape(y, (1, BLOCK)), 1, BLOCK, FLOOR)
    tl.store(q_ptr + row * K + col, tl.reshape(q, (BLOCK,)), mask=mask)
    g = tl.arange(0, BLOCK // 32)
    tl.store(s_ptr + row * (K // 32) + g, tl.reshape(s, (BLOCK // 32,)), mask=g < K // 32)


def rms_norm_act_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (fp32, rounded to x.dtype) then per-32 FP8 quantisation, one pass per row."""
    x = x.contiguous()
    q, s = _outputs(x)
    rows, k = x.numel() // x.shape[-1], x.shape[-1]
    if rows:
        block = max(32, triton.next_power_of_2(k))
        _rms_norm_quant_kernel[(rows,)](
            x,
            weight.contiguous(),
            q,
            s,
            k,
            float(eps),
            FLOOR=ACT_AMAX_FLOOR,
            BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )
    return q, s


@triton.jit
def swiglu_quant_tile(g, u, w, limit, HAS_LIMIT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """V4.1's clamped SwiGLU times the routing weight, rounded to OUT_DTYPE, as fp32."""
    if HAS_LIMIT:
        u = tl.clamp(u, -limit, limit)
        g = tl.minimum(g, limit)
    h = w * (g / (1.0 + tl.exp(-g)) * u)
    return h.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _swiglu_quant_kernel(
    g_ptr,
    u_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    R,
    K,
    limit,
    HAS_W: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    FLOOR: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """BLOCK_ROWS rows (of R) x WIDTH columns (of K) per program."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = row < R
    col = tl.program_id(1) * WIDTH + tl.arange(0, WIDTH)
    mask = rmask[:, None] & (col < K)[None, :]
    at = row[:, None] * K + col[None, :]
    g = tl.load(g_ptr + at, mask=mask, other=0.0)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:  # noqa: SIM108 (a Triton constexpr branch)
        w = tl.load(w_ptr + row, mask=rmask, other=0.0).to(tl.float32)[:, None]
    else:
        w = 1.0
    h = swiglu_quant_tile(g.to(tl.float32), u, w, limit, HAS_LIMIT, g_ptr.dtype.element_ty)
    q, s = quant_groups_fp8(h, BLOCK_ROWS, WIDTH, FLOOR)
    tl.store(q_ptr + at, q, mask=mask)
    gi = tl.program_id(1) * (WIDTH // 32) + tl.arange(0, WIDTH // 32)
    smask = rmask[:, None] & (gi < K // 32)[None, :]
    tl.store(s_ptr + row[:, None] * (K // 32) + gi[None, :], s, mask=smask)


def swiglu_act_quant_fp8(
    gate: torch.Tensor,
    up: torch.Tensor,
    route_weight: torch.Tensor | None,
    swiglu_limit: float,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(min(gate, L)) * clamp(up, +-L) * route_weight -> per-32 FP8 (the W2 input)."""
    gate, up = gate.contiguous(), up.contiguous()
    q, s = _outputs(gate)
    rows, k = gate.numel() // gate.shape[-1], gate.shape[-1]
    if rows:
        w = route_weight.contiguous().float() if route_weight is not None else gate
        block_rows, width, warps = _SWIGLU_TILE
        _swiglu_quant_kernel[_tile_grid(rows, k, _SWIGLU_TILE)](
            gate,
            up,
            w,
            q,
            s,
            rows,
            k,
            float(swiglu_limit),
            HAS_W=route_weight is not None,
            HAS_LIMIT=swiglu_limit > 0,
            FLOOR=ACT_AMAX_FLOOR,
            WIDTH=width,
            BLOCK_ROWS=block_rows,
            num_warps=warps,
        )
    return q, s
