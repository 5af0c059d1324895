"""Checks shared by the GPU test files (METHOD.md): poisoned outputs, relative error."""

from __future__ import annotations

import torch


def poison() -> None:
    """Fill the CUDA allocator's free blocks with NaN so an unwritten output element shows up."""
    torch.cuda.synchronize()
    blocks = [torch.full((1 << 24,), float("nan"), device="cuda") for _ in range(8)]
    del blocks


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64; a NaN in `got` (an unwritten element) fails."""
    assert not torch.isnan(got).any(), "NaN in output: an element was not written"
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
