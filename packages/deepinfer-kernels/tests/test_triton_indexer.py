"""The triton tier of `index_topk` and `candidate_blocks` (`triton/indexer.py`) against plain
python loops written here (the definition: rank by score descending, ties to the lower id, NaN
ranked first, pick the first k, keep the picks scored above -inf) and against the ref tier, id
for id: ties, -0.0 and 0.0, -inf, +inf, NaN, lens beyond N and 0, k above N, k 0, rows of
several tiles, int32/int64 lens, bf16 scores, strided rows.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU; with CUDA they run compiled.
"""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer_kernels.ref import indexer as ref
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_tier import DEV, triton_module

ti = triton_module("indexer")


def _rank(values: list[float], k: int) -> list[int]:
    """Ids of the first k in descending order, ties by id, NaN before everything."""

    def key(i: int):
        v = values[i]
        return (0, 0.0, i) if math.isnan(v) else (1, -v, i)

    return sorted(range(len(values)), key=key)[:k]


def loop_topk(scores: torch.Tensor, lens: torch.Tensor, topk: int) -> torch.Tensor:
    t = scores.shape[0]
    out = torch.full((t, topk), -1, dtype=torch.int64)
    for r in range(t):
        vals = [float(v) for v in scores[r].float().tolist()]
        vals = [v if j < int(lens[r]) else -math.inf for j, v in enumerate(vals)]
        kept = sorted(i for i in _rank(vals, topk) if vals[i] > -math.inf)
        out[r, : len(kept)] = torch.tensor(kept, dtype=torch.int64)
    return out


def loop_blocks(scores: torch.Tensor, lens: torch.Tensor, k: int, bs: int) -> torch.Tensor:
    t, n = scores.shape
    out = torch.zeros(t, n, dtype=torch.bool)
    nb = -(-n // bs)
    for r in range(t):
        ln = int(lens[r])
        vals = [float(v) if j < ln else -math.inf for j, v in enumerate(scores[r].float().tolist())]
        block = []
        for b in range(nb):
            part = vals[b * bs : (b + 1) * bs]
            block.append(math.nan if any(math.isnan(v) for v in part) else max(part))
        if ln > 0 and (ln - 1) // bs < nb:
            block[(ln - 1) // bs] = math.inf
        for b in _rank(block, k):
            if block[b] > -math.inf:
                for j in range(b * bs, min((b + 1) * bs, n)):
                    out[r, j] = j < ln
    return out


def _run_topk(scores, lens, k):
    return ti.index_topk(scores.to(DEV), lens.to(DEV), k).cpu()


def _run_blocks(scores, lens, k, bs):
    return ti.candidate_blocks(scores.to(DEV), lens.to(DEV), k, bs).cpu()


def _scores(seed: int, t: int, n: int, levels: int) -> torch.Tensor:
    """Scores drawn from `levels` distinct values (many ties), with -0.0/0.0, -inf, +inf
    sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-levels, levels + 1, (t, n), generator=g).float() / 4
    special = torch.tensor([-0.0, 0.0, -math.inf, math.inf])
    pick = torch.rand(t, n, generator=g) < 0.1
    s[pick] = special[torch.randint(0, 4, (int(pick.sum()),), generator=g)]
    return s


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    t=st.integers(1, 5),
    n=st.integers(1, 70),
    k=st.integers(0, 80),
    levels=st.sampled_from([1, 3, 50]),
)
def test_index_topk_equals_loop_and_ref(seed, t, n, k, levels):
    scores = _scores(seed, t, n, levels)
    lens = torch.randint(0, n + 3, (t,), generator=torch.Generator().manual_seed(seed))
    want = loop_topk(scores, lens, k)
    assert torch.equal(ref.index_topk(scores, lens, k), want)
    assert torch.equal(_run_topk(scores, lens, k), want)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    t=st.integers(1, 4),
    n=st.integers(1, 60),
    k=st.integers(0, 12),
    bs=st.integers(1, 9),
    levels=st.sampled_from([1, 3, 50]),
)
def test_candidate_blocks_equal_loop_and_ref(seed, t, n, k, bs, levels):
    scores = _scores(seed, t, n, levels)
    lens = torch.randint(0, n + 3, (t,), generator=torch.Generator().manual_seed(seed + 1))
    want = loop_blocks(scores, lens, k, bs)
    assert torch.equal(ref.candidate_blocks(scores, lens, k, bs), want)
    assert torch.equal(_run_blocks(scores, lens, k, bs), want)


def test_nan_takes_a_slot_but_is_never_chosen():
    scores = torch.tensor([[1.0, math.nan, 3.0, math.nan, 2.0, 0.5]])
    lens = torch.tensor([6])
    for k in range(0, 8):
        want = loop_topk(scores, lens, k)
        assert torch.equal(ref.index_topk(scores, lens, k), want), k
        assert torch.equal(_run_topk(scores, lens, k), want), k
    for k in range(0, 4):
        want = loop_blocks(scores, lens, k, 2)
        assert torch.equal(ref.candidate_blocks(scores, lens, k, 2), want), k
        assert torch.equal(_run_blocks(scores, lens, k, 2), want), k


@pytest.mark.parametrize("n,k", [(3000, 512), (1500, 2000), (2600, 7)])
def test_rows_of_several_tiles(n, k):
    """Rows longer than one 1024-entry tile: ties across tile borders go to the lower id."""
    scores = _scores(n, 3, n, 20)
    lens = torch.tensor([n, n - 700, 1], dtype=torch.int32)
    want = loop_topk(scores, lens, k)
    assert torch.equal(ref.index_topk(scores, lens, k), want)
    assert torch.equal(_run_topk(scores, lens, k), want)
    want_b = loop_blocks(scores, lens, k // 4 + 1, 8)
    assert torch.equal(_run_blocks(scores, lens, k // 4 + 1, 8), want_b)


def test_bf16_and_strided_rows():
    full = _scores(7, 4, 90, 30)
    scores = full[:, 5:70]  # row stride 90, unit column stride
    lens = torch.tensor([65, 30, 0, 64])
    want = loop_topk(scores, lens, 16)
    assert torch.equal(_run_topk(scores, lens, 16), want)
    b16 = scores.to(torch.bfloat16)
    assert torch.equal(_run_topk(b16, lens, 16), ref.index_topk(b16, lens, 16))
    assert torch.equal(_run_blocks(b16, lens, 3, 4), ref.candidate_blocks(b16, lens, 3, 4))
    transposed = full[:, :40].t().contiguous().t()  # column stride 4: copied to rows
    assert torch.equal(_run_topk(transposed, lens, 16), ref.index_topk(transposed, lens, 16))


def test_empty_shapes():
    assert torch.equal(
        _run_topk(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64), 3), torch.full((0, 3), -1)
    )
    assert torch.equal(
        _run_topk(torch.zeros(2, 0), torch.zeros(2, dtype=torch.int64), 3), torch.full((2, 3), -1)
    )
    assert _run_blocks(torch.zeros(2, 0), torch.zeros(2, dtype=torch.int64), 3, 2).shape == (2, 0)


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="lens"):
        ti.index_topk(torch.zeros(2, 4, device=DEV), torch.zeros(3, device=DEV), 2)
    with pytest.raises(ValueError, match="scores"):
        ti.index_topk(torch.zeros(4, device=DEV), torch.zeros(4, device=DEV), 2)
    with pytest.raises(ValueError, match="block_size"):
        ti.candidate_blocks(torch.zeros(2, 4, device=DEV), torch.zeros(2, device=DEV), 2, 0)
