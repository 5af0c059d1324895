"""Properties of the EPLB rebalancing algorithm, checked with plain Python loops."""

from __future__ import annotations

import pytest
import torch
from deepinfer_parallel.eplb import balanced_packing, rebalance_experts, replicate_experts
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def placement_cases(draw, identity_comparable: bool = False):
    """A satisfiable (load, slots, groups, nodes, gpus, policy) case."""
    num_nodes = draw(st.sampled_from([1, 2, 3]))
    num_gpus = num_nodes * draw(st.integers(1, 3))
    slots_per_gpu = draw(st.integers(1, 5))
    num_physical = num_gpus * slots_per_gpu
    if identity_comparable:
        num_logical = num_gpus * draw(st.integers(1, slots_per_gpu))
    else:
        num_logical = draw(st.integers(1, num_physical))
    policy = draw(st.sampled_from(["hierarchical", "global", "auto"]))
    divisors = [d for d in range(1, num_logical + 1) if num_logical % d == 0]
    if policy == "hierarchical":
        divisors = [d for d in divisors if d % num_nodes == 0]
        if not divisors:
            policy = "global"
            divisors = [1]
    num_groups = draw(st.sampled_from(divisors))
    layers = draw(st.integers(1, 3))
    skewed = draw(st.booleans())
    load = []
    for _ in range(layers):
        if skewed:  # a few hot experts, many cold ones
            hot = st.sampled_from([1, 1, 1, 50])
            row = [draw(st.integers(0, 10)) * draw(hot) for _ in range(num_logical)]
        else:
            row = [draw(st.integers(0, 1000)) for _ in range(num_logical)]
        load.append(row)
    return load, num_physical, num_groups, num_nodes, num_gpus, policy


def _gpu_loads(load_row, phy2log_row, num_gpus):
    """Per-GPU load with each expert's load split evenly over its replicas (float64 loops)."""
    count = {}
    for e in phy2log_row:
        count[e] = count.get(e, 0) + 1
    per_gpu = len(phy2log_row) // num_gpus
    out = []
    for g in range(num_gpus):
        total = 0.0
        for e in phy2log_row[g * per_gpu : (g + 1) * per_gpu]:
            total += float(load_row[e]) / count[e]
        out.append(total)
    return out


@SETTINGS
@given(placement_cases())
def test_every_expert_has_a_replica_and_every_gpu_is_full(case):
    load, num_physical, num_groups, num_nodes, num_gpus, policy = case
    p = rebalance_experts(torch.tensor(load), num_physical, num_groups, num_nodes, num_gpus, policy)
    num_layers, num_logical = len(load), len(load[0])
    assert p.phy2log.shape == (num_layers, num_physical)
    assert p.logcnt.shape == (num_layers, num_logical)
    assert p.slots_per_gpu * num_gpus == num_physical
    for layer in range(num_layers):
        row = p.phy2log[layer].tolist()
        assert all(0 <= e < num_logical for e in row)  # no empty slot on any GPU
        assert set(row) == set(range(num_logical))  # every logical expert placed
        assert min(p.logcnt[layer].tolist()) >= 1
        assert sum(p.logcnt[layer].tolist()) == num_physical


@SETTINGS
@given(placement_cases())
def test_mappings_invert_each_other(case):
    load, num_physical, num_groups, num_nodes, num_gpus, policy = case
    p = rebalance_experts(torch.tensor(load), num_physical, num_groups, num_nodes, num_gpus, policy)
    for layer in range(len(load)):
        phy2log = p.phy2log[layer].tolist()
        log2phy = p.log2phy[layer].tolist()
        logcnt = p.logcnt[layer].tolist()
        for e, slots in enumerate(log2phy):
            real = slots[: logcnt[e]]
            assert all(s == -1 for s in slots[logcnt[e] :])
            assert real == sorted(real) and len(set(real)) == len(real)
            assert all(phy2log[s] == e for s in real)
            assert logcnt[e] == sum(1 for x in phy2log if x == e)
        for s, e in enumerate(phy2log):
            assert s in log2phy[e][: logcnt[e]]


@SETTINGS
@given(placement_cases(identity_comparable=True))
def test_max_gpu_load_never_above_identity_placement(case):
    load, num_physical, num_groups, num_nodes, num_gpus, policy = case
    p = rebalance_experts(torch.tensor(load), num_physical, num_groups, num_nodes, num_gpus, policy)
    num_logical = len(load[0])
    per_gpu = num_logical // num_gpus
    for layer, row in enumerate(load):
        identity_max = max(
            sum(float(x) for x in row[g * per_gpu : (g + 1) * per_gpu]) for g in range(num_gpus)
        )
        eplb_max = max(_gpu_loads(row, p.phy2log[layer].tolist(), num_gpus))
        assert eplb_max <= identity_max * (1 + 1e-12) + 1e-9


@SETTINGS
@given(placement_cases())
def test_hierarchical_keeps_each_group_on_one_node(case):
    load, num_physical, num_groups, num_nodes, num_gpus, policy = case
    if policy != "hierarchical":
        return
    p = rebalance_experts(torch.tensor(load), num_physical, num_groups, num_nodes, num_gpus, policy)
    group_size = len(load[0]) // num_groups
    slots_per_node = num_physical // num_nodes
    for layer in range(len(load)):
        node_of_group = {}
        for slot, e in enumerate(p.phy2log[layer].tolist()):
            node = slot // slots_per_node
            assert node_of_group.setdefault(e // group_size, node) == node
        # equal number of groups per node
        per_node = [sum(1 for n in node_of_group.values() if n == k) for k in range(num_nodes)]
        assert len(set(per_node)) == 1


@SETTINGS
@given(
    num_gpus=st.sampled_from([1, 2, 4, 8]),
    experts_per_gpu=st.integers(1, 6),
    redundant_per_gpu=st.integers(0, 3),
    policy=st.sampled_from(["hierarchical", "global"]),
    value=st.integers(1, 100),
)
def test_uniform_load_replicates_nothing_needlessly(
    num_gpus, experts_per_gpu, redundant_per_gpu, policy, value
):
    num_logical = num_gpus * experts_per_gpu
    num_physical = num_logical + num_gpus * redundant_per_gpu
    num_nodes = 2 if num_gpus % 2 == 0 and policy == "hierarchical" else 1
    load = torch.full((2, num_logical), value)
    p = rebalance_experts(load, num_physical, num_nodes, num_nodes, num_gpus, policy)
    redundant = num_physical - num_logical
    for layer in range(2):
        cnt = p.logcnt[layer].tolist()
        # Spare slots are spread one per expert: nobody gets a second extra replica while
        # another expert has none.
        assert max(cnt) - min(cnt) <= 1
        if redundant == 0:
            assert cnt == [1] * num_logical
            gpu = _gpu_loads(load[layer].tolist(), p.phy2log[layer].tolist(), num_gpus)
            assert max(gpu) == min(gpu)


def test_hot_expert_gets_the_spare_slots():
    load = torch.tensor([[1000, 1, 1, 1, 1, 1, 1, 1]])
    p = rebalance_experts(load, 12, num_gpus=4, policy="global")
    assert p.logcnt[0].tolist() == [5, 1, 1, 1, 1, 1, 1, 1]
    # The five replicas of the hot expert are on different GPUs where possible (4 GPUs).
    gpus = {int(s) // 3 for s in p.log2phy[0, 0, :5]}
    assert gpus == {0, 1, 2, 3}


def test_zero_load_is_fine():
    p = rebalance_experts(torch.zeros(2, 8), 8, num_gpus=2)
    assert p.logcnt.tolist() == [[1] * 8] * 2


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=12), st.integers(0, 8))
def test_replicate_experts_minimises_the_max_per_replica_load(weights, spare):
    item_of_slot, count = replicate_experts([float(w) for w in weights], len(weights) + spare)
    assert len(item_of_slot) == len(weights) + spare
    assert [sum(1 for i in item_of_slot if i == k) for k in range(len(weights))] == count
    got = max(w / c for w, c in zip(weights, count, strict=True))

    # Brute force over all count vectors with sum = n + spare, each >= 1.
    def best(i, left):
        if i == len(weights) - 1:
            return weights[i] / (1 + left)
        return min(max(weights[i] / (1 + k), best(i + 1, left - k)) for k in range(left + 1))

    if len(weights) <= 6 and spare <= 5:
        assert got == pytest.approx(best(0, spare))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.data())
def test_balanced_packing_gives_equal_counts(num_packs, per_pack, data):
    weights = data.draw(
        st.lists(st.floats(0, 10), min_size=num_packs * per_pack, max_size=num_packs * per_pack)
    )
    pack_of, rank_of = balanced_packing(weights, num_packs)
    for pack in range(num_packs):
        ranks = sorted(r for p, r in zip(pack_of, rank_of, strict=True) if p == pack)
        assert ranks == list(range(per_pack))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_physical_experts=18, num_gpus=4), "divisible by num_gpus"),
        (dict(num_physical_experts=4, num_gpus=2), "must be >= the number of logical experts"),
        (
            dict(
                num_physical_experts=8, num_groups=2, num_nodes=4, num_gpus=4, policy="hierarchical"
            ),
            "num_groups \\(2\\) divisible by num_nodes \\(4\\)",
        ),
        (dict(num_physical_experts=8, num_groups=3, num_gpus=2), "divisible by num_groups"),
        (dict(num_physical_experts=8, num_nodes=3, num_gpus=4), "divisible by num_nodes"),
        (dict(num_physical_experts=8, num_gpus=2, policy="best"), "policy must be one of"),
        (dict(num_physical_experts=8, num_gpus=0), "num_gpus must be a positive int"),
    ],
)
def test_unsatisfiable_inputs_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.ones(2, 8), **kwargs)


def test_bad_load_raises():
    with pytest.raises(ValueError, match="load must be \\[layers, logical_experts\\]"):
        rebalance_experts(torch.ones(8), 8)
    with pytest.raises(ValueError, match="finite and >= 0"):
        rebalance_experts(torch.tensor([[1.0, -1.0]]), 2)
    with pytest.raises(ValueError, match="finite and >= 0"):
        rebalance_experts(torch.tensor([[1.0, float("nan")]]), 2)


def test_auto_policy_falls_back_to_global_when_groups_do_not_fit_nodes():
    load = torch.arange(12.0).reshape(1, 12)
    auto = rebalance_experts(load, 12, num_groups=3, num_nodes=2, num_gpus=2, policy="auto")
    glob = rebalance_experts(load, 12, num_groups=3, num_nodes=2, num_gpus=2, policy="global")
    assert torch.equal(auto.phy2log, glob.phy2log)


def test_greedy_packing_that_loses_to_identity_falls_back_to_identity():
    # Greedy heaviest-first packing puts 13+7+5=25 on one GPU; the identity placement has
    # max(7+11+5, 10+13+1) = 24. The result must be no worse than identity.
    load = torch.tensor([[7, 11, 5, 10, 13, 1]])
    p = rebalance_experts(load, 6, num_gpus=2, policy="global")
    assert max(_gpu_loads(load[0].tolist(), p.phy2log[0].tolist(), 2)) == 24.0
