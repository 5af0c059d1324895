"""ops.fp8_linear / fp8_gemm / act-quant ops (ref tier on CPU) against float64 math in the test."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels import ops, quant
from f64_math import E4M3, quant_group
from hypothesis import given, settings
from hypothesis import strategies as st


def _quant_rows_f64(x: torch.Tensor) -> list[list[float]]:
    """Per-32 FP8 quantise-dequantise of each row, in float64 by grid search."""
    out = []
    for row in x.double().tolist():
        q = []
        for g in range(0, len(row), 32):
            q += quant_group(row[g : g + 32], 448.0, E4M3, 1e-4)
        out.append(q)
    return out


def _linear_f64(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """sum_k xq[m, k] * w[n, k] * scale[n // 32, k // 32] with float64 loops over blocks."""
    xq = torch.tensor(_quant_rows_f64(x), dtype=torch.float64)
    n, k = w_fp8.shape
    w = w_fp8.double()
    s = w_scale.double()
    out = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for bn in range(0, n, 32):
        for bk in range(0, k, 32):
            blk = w[bn : bn + 32, bk : bk + 32] * s[bn // 32, bk // 32].item()
            out[:, bn : bn + 32] += xq[:, bk : bk + 32] @ blk.t()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@settings(max_examples=12, deadline=None)
@given(
    m=st.integers(1, 9),
    n=st.integers(1, 70),
    kb=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_fp8_linear_fp32_against_float64(m, n, kb, seed):
    gen = torch.Generator().manual_seed(seed)
    k = 32 * kb
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen))
    w_fp8, w_scale = quant.quantize_fp8_blocks(torch.randn(n, k, generator=gen) * 0.05)
    got = ops.fp8_linear(x, w_fp8, w_scale)
    assert got.dtype == torch.float32 and tuple(got.shape) == (m, n)
    want = _linear_f64(x, w_fp8, w_scale)
    assert _rel(got, want) < 1e-6


def test_fp8_linear_bf16_leading_dims():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 64, generator=gen).bfloat16()
    w_fp8, w_scale = quant.quantize_fp8_blocks(torch.randn(40, 64, generator=gen))
    got = ops.fp8_linear(x, w_fp8, w_scale)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (2, 3, 40)
    want = _linear_f64(x.reshape(6, 64), w_fp8, w_scale).reshape(2, 3, 40)
    assert _rel(got, want) < 4e-3  # bf16 output rounding only


def test_fp8_gemm_prequantised_matches_linear():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=gen)
    w_fp8, w_scale = quant.quantize_fp8_blocks(torch.randn(33, 96, generator=gen))
    xq, xs = ops.act_quant_fp8(x)
    got = ops.fp8_gemm(xq, xs, w_fp8, w_scale, torch.float32)
    assert _rel(got, _linear_f64(x, w_fp8, w_scale)) < 1e-6


def test_fp8_linear_batch_invariant_bitwise(batch_invariant):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 256, generator=gen).bfloat16()
    w_fp8, w_scale = quant.quantize_fp8_blocks(torch.randn(96, 256, generator=gen))
    full = ops.fp8_linear(x, w_fp8, w_scale)
    for i in (0, 13, 36):
        assert torch.equal(ops.fp8_linear(x[i : i + 1], w_fp8, w_scale)[0], full[i])
    assert torch.equal(ops.fp8_linear(x[5:9], w_fp8, w_scale), full[5:9])


def test_fp8_linear_bad_arguments():
    w_fp8, w_scale = quant.quantize_fp8_blocks(torch.randn(64, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.fp8_linear(torch.randn(2, 48), w_fp8[:, :48], w_scale)
    with pytest.raises(ValueError, match=r"w must be \[N, 32\]"):
        ops.fp8_linear(torch.randn(2, 32), w_fp8, w_scale)
    with pytest.raises(ValueError, match="w_scale must be"):
        ops.fp8_linear(torch.randn(2, 64), w_fp8, w_scale[:1])
    with pytest.raises(ValueError, match="w must have dtype"):
        ops.fp8_linear(torch.randn(2, 64), w_fp8.float(), w_scale)
    with pytest.raises(ValueError, match="x_scale must be"):
        ops.fp8_gemm(w_fp8, torch.ones(64, 1), w_fp8, w_scale)


def test_act_quant_op_matches_float64():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    q, s = ops.act_quant_fp8(x)
    assert quant.act_dequant_fp8(q, s, torch.float64).tolist() == _quant_rows_f64(x)
