"""Expert load window and replica routing."""

from __future__ import annotations

import pytest
import torch
from deepinfer_parallel.eplb import (
    ExpertLoadWindow,
    count_expert_tokens,
    logical_load_from_physical,
    rebalance_experts,
    select_replicas,
    token_hash,
)
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.data())
def test_window_sums_exactly_the_last_steps(window, steps, data):
    w = ExpertLoadWindow(num_layers=2, num_logical_experts=3, window_size=window)
    history = []
    for _ in range(steps):
        counts = data.draw(st.lists(st.integers(0, 50), min_size=6, max_size=6))
        history.append(counts)
        w.record(torch.tensor(counts).reshape(2, 3))
    expected = [0] * 6
    for counts in history[-window:]:
        expected = [a + b for a, b in zip(expected, counts, strict=True)]
    assert w.load().reshape(-1).tolist() == expected
    assert w.steps_in_window == min(steps, window)
    w.reset()
    assert w.load().sum().item() == 0 and w.steps_recorded == 0


def test_window_rejects_bad_counts():
    w = ExpertLoadWindow(2, 3, 4)
    with pytest.raises(ValueError, match="step_counts must have shape"):
        w.record(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer counts"):
        w.record(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="window_size must be a positive int"):
        ExpertLoadWindow(2, 3, 0)


def test_count_expert_tokens():
    topk = torch.tensor([[0, 2], [2, 3], [2, 0]])
    assert count_expert_tokens(topk, 5).tolist() == [2, 0, 3, 1, 0]
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        count_expert_tokens(topk, 3)


def test_logical_load_from_physical_sums_replicas():
    phy2log = torch.tensor([[0, 1, 0, 2]])
    phys = torch.tensor([[5, 1, 7, 2]])
    assert logical_load_from_physical(phys, phy2log, 3).tolist() == [[12, 1, 2]]


def _fmix32_py(h):
    h &= 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _token_hash_py(r, p):
    r &= (1 << 64) - 1  # two's complement view of a negative id
    p &= (1 << 64) - 1
    h = _fmix32_py((r & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = _fmix32_py(h ^ (r >> 32))
    h = _fmix32_py(h ^ (p & 0xFFFFFFFF))
    return _fmix32_py(h ^ (p >> 32))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**40)), min_size=1, max_size=20
    )
)
def test_token_hash_matches_python_big_ints(pairs):
    r = torch.tensor([a for a, _ in pairs])
    p = torch.tensor([b for _, b in pairs])
    assert token_hash(r, p).tolist() == [_token_hash_py(a, b) for a, b in pairs]


def _placement():
    load = torch.tensor([[900, 10, 10, 10, 300, 10, 10, 10]])
    return rebalance_experts(load, 16, num_gpus=4, policy="global")


def test_routed_slot_holds_the_logical_expert():
    p = _placement()
    g = torch.Generator().manual_seed(0)
    topk = torch.randint(0, 8, (500, 3), generator=g)
    for batch_invariant in (False, True):
        out = select_replicas(
            topk,
            p.log2phy[0],
            p.logcnt[0],
            batch_invariant=batch_invariant,
            request_ids=torch.randint(0, 10**9, (500,), generator=g),
            positions=torch.arange(500),
        )
        assert torch.equal(p.phy2log[0][out], topk)


def test_batch_invariant_routing_ignores_batch_composition():
    p = _placement()
    g = torch.Generator().manual_seed(1)
    n = 64
    topk = torch.randint(0, 8, (n, 2), generator=g)
    rid = torch.randint(0, 1000, (n,), generator=g)
    pos = torch.randint(0, 4096, (n,), generator=g)
    alone = select_replicas(
        topk, p.log2phy[0], p.logcnt[0], batch_invariant=True, request_ids=rid, positions=pos
    )
    # Shuffle rows and add unrelated tokens in front: each token keeps its replica.
    perm = torch.randperm(n, generator=g)
    extra = 17
    topk2 = torch.cat([torch.randint(0, 8, (extra, 2), generator=g), topk[perm]])
    rid2 = torch.cat([torch.randint(0, 1000, (extra,), generator=g), rid[perm]])
    pos2 = torch.cat([torch.randint(0, 4096, (extra,), generator=g), pos[perm]])
    mixed = select_replicas(
        topk2, p.log2phy[0], p.logcnt[0], batch_invariant=True, request_ids=rid2, positions=pos2
    )
    assert torch.equal(mixed[extra:], alone[perm])


def test_routing_spreads_tokens_evenly_over_replicas():
    p = _placement()
    cnt = int(p.logcnt[0, 0])
    assert cnt >= 3
    n = 20000
    topk = torch.zeros(n, 1, dtype=torch.int64)
    for batch_invariant in (False, True):
        out = select_replicas(
            topk,
            p.log2phy[0],
            p.logcnt[0],
            batch_invariant=batch_invariant,
            request_ids=torch.arange(n) // 100,
            positions=torch.arange(n) % 100,
        )
        per_slot = torch.bincount(out.reshape(-1), minlength=p.num_physical)
        used = per_slot[p.log2phy[0, 0, :cnt]].double()
        assert used.sum().item() == n
        assert (used / n - 1 / cnt).abs().max().item() < 0.02


def test_batch_invariant_needs_ids():
    p = _placement()
    with pytest.raises(ValueError, match="needs request_ids"):
        select_replicas(
            torch.zeros(2, 1, dtype=torch.int64), p.log2phy[0], p.logcnt[0], batch_invariant=True
        )
    with pytest.raises(ValueError, match="one layer"):
        select_replicas(torch.zeros(2, 1, dtype=torch.int64), p.log2phy, p.logcnt[0])
