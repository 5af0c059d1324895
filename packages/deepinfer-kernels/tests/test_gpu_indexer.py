"""The triton tier of `index_topk` and `candidate_blocks` on CUDA at V4.1-Flash's selection
sizes (top-512 entries, 2048 candidate blocks of 8), through the registry: id for id and bit for
bit equal to the ref tier run on the same device, also with many ties and masked rows; and no
host<->device sync. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels import REGISTRY, ops
from deepinfer_kernels.ref import indexer as ref

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the triton tier runs on CUDA only)"
)

DEV = "cuda"
TOPK, BLOCKS, BLOCK = 512, 2048, 8


def _case(t: int, n: int, seed: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    s = torch.randn(t, n, generator=g, device=DEV)
    if ties:
        s = (s * 4).round() / 4  # few distinct values: ties decide most picks
    lens = torch.randint(0, n + 1, (t,), generator=g, device=DEV)
    lens[0] = n
    return s, lens


@pytest.mark.parametrize("t,n", [(1, 40), (64, 30), (64, 700), (7, 5000), (300, 2100)])
@pytest.mark.parametrize("ties", [False, True])
def test_index_topk_equals_ref(t, n, ties):
    s, lens = _case(t, n, t * n, ties)
    assert REGISTRY.resolve("index_topk", s, lens, TOPK).tier == "triton"
    assert torch.equal(ops.index_topk(s, lens, TOPK), ref.index_topk(s, lens, TOPK))


@pytest.mark.parametrize("t,n", [(1, 40), (64, 30), (8, 20000), (33, 17000)])
@pytest.mark.parametrize("ties", [False, True])
def test_candidate_blocks_equal_ref(t, n, ties):
    s, lens = _case(t, n, t + n, ties)
    assert REGISTRY.resolve("candidate_blocks", s, lens, BLOCKS, BLOCK).tier == "triton"
    got = ops.candidate_blocks(s, lens, BLOCKS, BLOCK)
    assert torch.equal(got, ref.candidate_blocks(s, lens, BLOCKS, BLOCK))


def test_no_host_device_sync():
    s, lens = _case(64, 900, 5, True)
    ops.index_topk(s, lens, TOPK)  # compile outside the check
    ops.candidate_blocks(s, lens, BLOCKS, BLOCK)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.index_topk(s, lens, TOPK)
        ops.candidate_blocks(s, lens, BLOCKS, BLOCK)
    finally:
        torch.cuda.set_sync_debug_mode("default")
