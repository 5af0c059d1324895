"""Indexer scores, top-k and candidate blocks against plain loops."""

import torch
from deepinfer_kernels import ops
from hypothesis import given, settings
from hypothesis import strategies as st


def test_indexer_scores_matches_loop():
    g = torch.Generator().manual_seed(0)
    q, w, k = (
        torch.randn(3, 2, 8, generator=g),
        torch.randn(3, 2, generator=g),
        torch.randn(5, 8, generator=g),
    )
    got = ops.indexer_scores(q, w, k)
    for t in range(3):
        for n in range(5):
            want = sum(
                float(w[t, h]) * max(0.0, sum(float(q[t, h, c]) * float(k[n, c]) for c in range(8)))
                for h in range(2)
            )
            assert abs(float(got[t, n]) - want) < 1e-5


def _topk_loop(scores, lens, k):
    out = []
    for row, n in zip(scores.tolist(), lens.tolist(), strict=False):
        cand = [(-v, j) for j, v in enumerate(row[:n]) if v != float("-inf")]
        chosen = sorted(j for _, j in sorted(cand)[:k])
        out.append(chosen + [-1] * (k - len(chosen)))
    return out


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 4), n=st.integers(0, 12), k=st.integers(1, 6), seed=st.integers(0, 999))
def test_index_topk_matches_loop_with_ties(t, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-2, 3, (t, n), generator=g).float()  # many ties
    scores[scores == -2] = float("-inf")
    lens = torch.randint(0, n + 1, (t,), generator=g)
    assert ops.index_topk(scores, lens, k).tolist() == _topk_loop(scores, lens, k)


def _cand_loop(scores, lens, topk_blocks, bs):
    out = []
    for row, n in zip(scores.tolist(), lens.tolist(), strict=False):
        nb = -(-len(row) // bs)
        bsc = []
        for b in range(nb):
            vals = [row[j] for j in range(b * bs, min((b + 1) * bs, len(row))) if j < n]
            bsc.append(max(vals) if vals else float("-inf"))
        if n > 0:
            bsc[(n - 1) // bs] = float("inf")
        order = sorted(range(nb), key=lambda b: (-bsc[b], b))[:topk_blocks]
        keep = {b for b in order if bsc[b] > float("-inf")}
        out.append([(j // bs) in keep and j < n for j in range(len(row))])
    return out


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 3),
    n=st.integers(1, 13),
    tb=st.integers(1, 3),
    bs=st.integers(1, 4),
    seed=st.integers(0, 999),
)
def test_candidate_blocks_matches_loop(t, n, tb, bs, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(t, n, generator=g)
    lens = torch.randint(0, n + 1, (t,), generator=g)
    assert ops.candidate_blocks(scores, lens, tb, bs).tolist() == _cand_loop(scores, lens, tb, bs)


def test_newest_block_is_pinned():
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, -9.0]])
    mask = ops.candidate_blocks(scores, torch.tensor([5]), 1, 2)
    # only one block kept: the newest (entry 4), despite its low score
    assert mask.tolist() == [[False, False, False, False, True]]
