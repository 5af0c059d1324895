"""The step agreement, sharded Engram lookups and expert moves over 2 and 4 gloo ranks."""

from __future__ import annotations

import torch
from deepinfer_parallel.engram_shard import RowShard, ShardedRows
from deepinfer_parallel.eplb import exchange_experts, plan_moves
from deepinfer_parallel.local_ranks import run_local_ranks
from deepinfer_parallel.step_sync import StepDemand, StepSync

ROWS, ROW_BYTES = 37, 5


def _table() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 256, (ROWS, ROW_BYTES), generator=g, dtype=torch.uint8)


def _body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    out = {}
    # the agreement: max tokens, any prefill, any unfinished
    plan = StepSync(group).agree(StepDemand(rank * 3, rank == 1, rank == world - 1))
    out["plan"] = [plan.rows, plan.prefill, plan.busy, plan.abort]
    # sharded lookups == the whole table, including a rank with no ids
    table = _table()
    shard = RowShard(ROWS, world, rank)
    local = table[shard.lo : shard.hi]
    n = 0 if rank == 0 else 4 + rank
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, ROWS, (n,), generator=g)
    got = ShardedRows(group, shard).lookup(ids, lambda i: local[i], ROW_BYTES, padded=4 + world)
    out["lookup"] = bool(torch.equal(got, table[ids]))
    # expert moves: each slot ends up with its new expert's bytes
    s = 3
    old = [e % 5 for e in range(world * s)]
    new = [(2 * e + 1) % 5 for e in range(world * s)]
    for e in range(5):  # every logical expert keeps a slot somewhere
        if e not in new:
            new[e] = e
    stacks_of = lambda slots: [  # noqa: E731 - two tensors per expert, their id repeated
        torch.tensor([[float(x)] * 4 for x in slots]),
        torch.tensor([[x] * 2 for x in slots], dtype=torch.int8),
    ]
    mine = stacks_of(old[rank * s : (rank + 1) * s])
    moved = exchange_experts(mine, plan_moves(old, new, s), rank, group)
    want = stacks_of(new[rank * s : (rank + 1) * s])
    out["moves"] = all(torch.equal(a, b) for a, b in zip(moved, want, strict=True))
    return out


def test_step_sync_lookup_and_moves_on_2_and_4_ranks():
    for world in (2, 4):
        results = run_local_ranks(_body, world, args=(world,), timeout_s=90)
        for r in results:
            assert r["plan"] == [3 * (world - 1), True, True, False]
            assert r["lookup"] and r["moves"], r
