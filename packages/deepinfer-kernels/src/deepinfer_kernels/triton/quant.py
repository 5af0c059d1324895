"""Triton activation quantisation: FP8 e4m3 per 32 channels (plain, or expanded back to bf16 for
the GEMMs' A operand), and the clamped SwiGLU x routing weight tile the MoE kernels fuse. Same
numerics as `ref/quant.py`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import ACT_AMAX_FLOOR
from ._common import quant_groups_fp8

# A tile: (rows, columns, warps) per program, the measured fastest (PERF.md); a row's groups do
# not depend on the tile. Gathered rows take one row per program.
_TILE = (4, 1024, 8)
_GATHER_TILE = (1, 1024, 4)


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
def swiglu_quant_tile(g, u, w, limit, HAS_LIMIT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """V4.1's clamped SwiGLU times the routing weight, rounded to OUT_DTYPE, as fp32."""
    if HAS_LIMIT:
        u = tl.clamp(u, -limit, limit)
        g = tl.minimum(g, limit)
    h = w * (g / (1.0 + tl.exp(-g)) * u)
    return h.to(OUT_DTYPE).to(tl.float32)
