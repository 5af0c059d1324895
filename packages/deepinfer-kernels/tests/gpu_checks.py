"""Checks shared by the GPU test files (METHOD.md): poisoned outputs, relative error."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels import quant

HOPPER_TILELANG = [
    pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
        reason="needs a Hopper GPU (sm_90a wgmma)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("tilelang") is None, reason="tilelang is not importable"
    ),
]
"""`pytestmark` of the TileLang GPU test files."""


def poison() -> None:
    """Fill the CUDA allocator's free blocks with NaN so an unwritten output element shows up."""
    torch.cuda.synchronize()
    blocks = [torch.full((1 << 24,), float("nan"), device="cuda") for _ in range(8)]
    del blocks


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64; a NaN in `got` (an unwritten element) fails."""
    assert not torch.isnan(got).any(), "NaN in output: an element was not written"
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def gemm_inputs(m: int, n: int, k: int, seed: int):
    """FP8 GEMM operands on CUDA: activations with per-row magnitudes, quantised per 32; 32x32
    weight blocks whose magnitudes differ by up to 2**+-6, so that their UE8M0 scales differ (a
    kernel reading a wrong weight or activation scale shows). -> (xq, xs, w, ws)"""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.exp(
        torch.randn(m, 1, device="cuda", generator=g)
    )
    spread = torch.randint(-6, 7, (-(-n // 32), k // 32), device="cuda", generator=g).float().exp2()
    spread = spread.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)
    w, ws = quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.02 * spread)
    xq, xs = quant.act_quant_fp8(x)
    return xq, xs, w, ws
