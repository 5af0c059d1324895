"""Online EPLB on one rank: records, rebalances on schedule, and evens out a skewed load."""

from __future__ import annotations

import pytest
import torch
from deepinfer_parallel.eplb import OnlineEPLB, initial_placement, plan_moves


def test_initial_placement_is_the_identity_with_local_replicas():
    p = initial_placement(2, 8, 10, 2)
    assert p.phy2log[0].tolist() == [0, 1, 2, 3, 0, 4, 5, 6, 7, 4]
    assert p.logcnt[0].tolist() == [2, 1, 1, 1, 2, 1, 1, 1]
    uneven = initial_placement(1, 6, 8, 4)  # 6 experts on 4 ranks: balanced packing
    assert sorted(set(uneven.phy2log[0].tolist())) == list(range(6))


def test_rebalance_on_schedule_lowers_max_over_mean_per_rank():
    layers, experts, ranks = 3, 8, 4
    placement = initial_placement(layers, experts, experts + ranks, ranks)
    eplb = OnlineEPLB(placement, window_size=4, interval=3)
    g = torch.Generator().manual_seed(0)
    # a skewed load: experts 0 and 1 (both on rank 0) take most tokens
    probs = torch.tensor([30.0, 20, 1, 1, 1, 1, 1, 1])
    results = []
    for _ in range(3):
        for layer in range(layers):
            ids = torch.multinomial(probs, 2 * 64, replacement=True, generator=g).view(64, 2)
            eplb.record(layer, ids)
        results.append(eplb.end_step(None))
    assert results[0] is None and results[1] is None and results[2] is not None
    load = eplb.window.load()
    before = placement.gpu_load(load)
    after = results[2].gpu_load(load)
    ratio = lambda x: (x.max(1).values / x.mean(1)).max().item()  # noqa: E731
    assert ratio(after) < 0.6 * ratio(before)
    eplb.adopt(results[2])
    assert eplb.placement is results[2] and eplb.rebalances == 1
    # every new slot has a source that holds its expert now
    for layer in range(layers):
        old = placement.phy2log[layer].tolist()
        new = results[2].phy2log[layer].tolist()
        for p, (r, s) in enumerate(plan_moves(old, new, 3)):
            assert old[r * 3 + s] == new[p]


def test_interval_zero_is_refused():
    with pytest.raises(ValueError, match="interval=0"):
        OnlineEPLB(initial_placement(1, 4, 4, 2), 10, 0)
