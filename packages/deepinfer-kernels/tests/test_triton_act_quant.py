"""The triton tier's activation fake-quantiser (`triton/quant.py`, `act_fake_quant_bf16`) with
its gathered rows and permuted columns (what the cuda MoE kernels' TMA path reads): bitwise the
plain result indexed afterwards (test_gpu.py checks the plain result against the reference).

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU; with CUDA it runs compiled."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.cuda.moe import k_permutation
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_tier import DEV, triton_module

tq = triton_module("quant")


@settings(max_examples=8, deadline=None)
@given(
    t=st.integers(1, 6),
    k=st.sampled_from([128, 256, 384, 640]),
    rows=st.lists(st.integers(0, 5), min_size=0, max_size=9),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_gathered_and_permuted_rows_are_the_plain_ones_indexed(t, k, rows, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, k, generator=g) * scale).bfloat16().to(DEV)
    idx = torch.tensor([r % t for r in rows], dtype=torch.int32, device=DEV)
    plain = tq.act_fake_quant_bf16(x)
    perm = k_permutation(k).to(DEV)
    assert torch.equal(tq.act_fake_quant_bf16(x, idx), plain[idx.long()])
    assert torch.equal(tq.act_fake_quant_bf16(x, idx, permute_k=True), plain[idx.long()][:, perm])
    assert torch.equal(tq.act_fake_quant_bf16(x, permute_k=True), plain[:, perm])


def test_permuted_columns_need_whole_steps():
    with pytest.raises(ValueError, match="permute_k needs K a multiple of 128, got 96"):
        tq.act_fake_quant_bf16(torch.zeros(2, 96, dtype=torch.bfloat16, device=DEV), permute_k=True)
