"""MoE dispatch/combine over gloo ranks == the dense MoE, for any routing and any token counts.

The property runs inside every rank with the same derandomised examples (hypothesis draws the
same data in each process); each example's verdict is all-reduced so all ranks stop together.
The expert kernel is a small pure-torch one with the reference kernel's contract: ascending
expert order, fp32 accumulation, each row on its own.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_parallel.expert_dispatch import (
    AllGatherDispatch,
    AllToAllDispatch,
    ExpertShard,
    sum_in_expert_order,
)
from deepinfer_parallel.local_ranks import run_local_ranks
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

D, K = 16, 2
N_LOGICAL = 4


def _experts(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, D, D, generator=g) / D**0.5  # one [D, D] matrix per expert


def dense_moe(x, weights, ids, mats) -> torch.Tensor:
    """The reference contract: per expert in ascending id, each row alone, fp32 sums."""
    y = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids[ids >= 0]).tolist():
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        out = torch.stack([torch.tanh(x[r] @ mats[e]) for r in rows.tolist()])
        y.index_add_(0, rows, out * weights[rows, slots, None])
    return y.to(x.dtype)


@st.composite
def routings(draw, world: int):
    """Per-rank token counts (zero allowed), each token's K distinct logical experts and
    weights, and a placement of the logical experts onto world * slots physical slots."""
    extra = draw(st.sampled_from([0, world]))
    slots = (N_LOGICAL + extra) // world
    phy2log = list(range(N_LOGICAL)) + [draw(st.integers(0, N_LOGICAL - 1)) for _ in range(extra)]
    perm = draw(st.permutations(range(N_LOGICAL + extra)))
    phy2log = [phy2log[p] for p in perm]
    ranks = []
    for _ in range(world):
        t = draw(st.integers(0, 4))
        tokens = []
        for _ in range(t):
            experts = draw(st.lists(st.integers(0, N_LOGICAL - 1), min_size=K, max_size=K,
                                    unique=True))  # fmt: skip
            weights = draw(st.lists(st.floats(0.1, 2.0), min_size=K, max_size=K))
            replica = [draw(st.integers(0, 7)) for _ in range(K)]
            tokens.append((experts, weights, replica))
        ranks.append(tokens)
    return {"slots": slots, "phy2log": phy2log, "ranks": ranks}


def _rank_body(rank: int, world: int, max_examples: int) -> int:
    import torch.distributed as dist

    torch.manual_seed(0)
    group = dist.group.WORLD
    checked = [0]

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(routings(world))
    def check(ex):
        slots_per_rank, phy2log = ex["slots"], ex["phy2log"]
        mats_logical = _experts(N_LOGICAL)
        shard = ExpertShard(rank, world, slots_per_rank)
        local_mats = mats_logical[
            torch.tensor(phy2log[rank * slots_per_rank : (rank + 1) * slots_per_rank])
        ]
        tokens = ex["ranks"][rank]
        t = len(tokens)
        g = torch.Generator().manual_seed(1000 + rank * 97 + t)
        x = torch.randn(t, D, generator=g)
        logical = torch.tensor([tok[0] for tok in tokens], dtype=torch.int64).reshape(t, K)
        weights = torch.tensor([tok[1] for tok in tokens], dtype=torch.float32).reshape(t, K)
        # a replica of each chosen logical expert, picked by the drawn index
        replicas = {e: [p for p, v in enumerate(phy2log) if v == e] for e in range(N_LOGICAL)}
        slots = torch.tensor(
            [
                [replicas[e][r % len(replicas[e])] for e, r in zip(tok[0], tok[2], strict=True)]
                for tok in tokens
            ],
            dtype=torch.int64,
        ).reshape(t, K)
        rows = max(len(r) for r in ex["ranks"])
        want = dense_moe(x, weights, logical, mats_logical)

        def compute(xr, wr, ir):
            return dense_moe(xr, wr, ir, local_mats)

        ok = True
        for cls in (AllGatherDispatch, AllToAllDispatch):
            for exact in (False, True):
                backend = cls(group, shard)
                got = backend.routed(x, weights, slots, logical, compute, rows, exact=exact)
                if exact:
                    ok &= bool(torch.equal(got, want))
                else:
                    ok &= bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6))
        verdict = torch.tensor([int(ok)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
        assert int(verdict) == 1, f"rank {rank}: a backend differs from the dense MoE on {ex}"
        checked[0] += 1

    check()
    return checked[0]


@pytest.mark.parametrize("world", [2])
def test_dispatch_combine_equals_dense_moe(world):
    counts = run_local_ranks(_rank_body, world, args=(world, 25), timeout_s=120)
    assert counts == [counts[0]] * world and counts[0] >= 10


def test_sum_in_expert_order_is_the_reference_order():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, D, generator=g)
    mats = _experts(N_LOGICAL)
    ids = torch.tensor([[3, 1], [0, 2], [2, 0], [1, 3], [0, 1]])
    w = torch.rand(5, K, generator=g) + 0.1
    per_slot = torch.stack(
        [dense_moe(x, w[:, j : j + 1], ids[:, j : j + 1], mats) for j in range(K)], dim=1
    )
    assert torch.equal(sum_in_expert_order(per_slot, ids), dense_moe(x, w, ids, mats))


def test_shard_maps_slots_to_local_ids():
    shard = ExpertShard(1, 3, 2)
    slots = torch.tensor([[0, 2], [3, 5], [-1, 4]])
    assert shard.local_ids(slots).tolist() == [[-1, 0], [1, -1], [-1, -1]]
    assert shard.rank_of(torch.tensor([0, 1, 2, 5])).tolist() == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="ep_rank=3"):
        ExpertShard(3, 3, 2)
