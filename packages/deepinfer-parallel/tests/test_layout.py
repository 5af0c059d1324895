"""Parallel layouts: who is in which group, what fails before anything loads."""

from __future__ import annotations

import itertools

import pytest
from deepinfer_parallel.dp_balance import RankLoad, assign_requests
from deepinfer_parallel.layout import LayoutError, ParallelLayout, engram_row_range
from hypothesis import given, settings
from hypothesis import strategies as st

sizes = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=60, deadline=None)
@given(sizes, sizes, sizes)
def test_every_rank_is_in_exactly_one_group_of_each_kind(d, e, g):
    layout = ParallelLayout(d, e, g)
    w = layout.world_size
    assert w == max(d, e, g)
    for groups, size in (
        (layout.dp_replica_groups(), w // d),
        (layout.ep_groups(), e),
        (layout.engram_groups(), g),
    ):
        assert sorted(r for grp in groups for r in grp) == list(range(w))
        assert all(len(grp) == size for grp in groups)
    for r in range(w):
        c = layout.coords(r)
        assert layout.dp_replica_groups()[c.dp_rank][c.dp_replica] == r
        assert layout.ep_groups()[c.ep_group][c.ep_rank] == r
        assert layout.engram_groups()[c.engram_group][c.engram_rank] == r
    assert layout.dp_leaders() == [grp[0] for grp in layout.dp_replica_groups()]


def test_sizes_that_do_not_divide_the_world_name_the_numbers():
    with pytest.raises(LayoutError, match=r"data=2, expert=3.*need 3 ranks.*data=2 does not"):
        ParallelLayout(2, 3, 1)
    with pytest.raises(LayoutError, match="expert_parallel_size=0"):
        ParallelLayout(1, 0, 1)


def test_experts_and_devices_are_checked():
    layout = ParallelLayout(2, 4, 1)
    layout.check(num_experts=8, extra_experts=4, num_devices=4)
    with pytest.raises(LayoutError, match=r"8 routed experts \+ 2 redundant slots = 10.*=4"):
        layout.check(num_experts=8, extra_experts=2)
    with pytest.raises(LayoutError, match="need 4 ranks, one device each, but only 2"):
        layout.check(num_devices=2)
    with pytest.raises(LayoutError, match="need expert_parallel_size > 1"):
        ParallelLayout(2, 1, 1).check(num_experts=8, extra_experts=2)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**9), st.integers(1, 16))
def test_engram_rows_have_exactly_one_owner(rows, parts):
    ranges = [engram_row_range(rows, parts, p) for p in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_full_width_engram_tables_split_over_eight_ranks():
    # V4.1-Flash: 384006168 and 384016682 rows
    for rows in (384006168, 384016682):
        ranges = [engram_row_range(rows, 8, p) for p in range(8)]
        assert sum(hi - lo for lo, hi in ranges) == rows
        assert {hi - lo for lo, hi in ranges} <= {rows // 8, rows // 8 + 1}


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 5000), max_size=40),
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), min_size=1, max_size=8),
)
def test_load_balancing_keeps_the_spread_within_one_request(costs, start):
    loads = [RankLoad(w, kv) for w, kv in start]
    ranks = assign_requests(costs, loads)
    assert len(ranks) == len(costs) and all(0 <= r < len(loads) for r in ranks)
    final = [load.total for load in loads]
    for c, r in zip(costs, ranks, strict=True):
        final[r] += c
    got = [final[r] for r in range(len(loads)) if r in ranks]
    if got:
        # greedy list scheduling: a rank that took work was the least loaded when it took its
        # last request
        assert max(got) - min(final) <= max(costs)
    assert assign_requests(costs, loads) == ranks  # deterministic


def test_load_balancing_prefers_the_idle_rank_not_the_next_one():
    # rank 0 already holds a long prompt: round-robin would give it the next request too
    assert assign_requests([10, 10, 10], [RankLoad(1000, 0), RankLoad(0, 0)]) == [1, 1, 1]
    # KV use counts as load too: 8 held tokens weigh more than 4 waiting ones
    assert assign_requests([5, 5], [RankLoad(0, 8), RankLoad(4, 0)]) == [1, 0]
