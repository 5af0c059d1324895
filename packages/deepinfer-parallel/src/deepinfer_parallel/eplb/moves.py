"""Moving expert weights to a new placement between two steps (`plan_moves`, `exchange_experts`).

After a rebalance every rank of an EP group knows the old and the new `phy2log` of a layer.
Each new slot takes its expert's bytes from a rank that holds that expert now: the rank itself
if it does (no traffic), else the lowest rank that does. Every rank derives the same plan from
the same tables, so one `all_to_all_single` of packed bytes per layer moves everything (the
splits are known on every rank: no count exchange). Replicas hold identical bytes, so no
request's output depends on where its experts ended up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def plan_moves(
    old_phy2log: Sequence[int], new_phy2log: Sequence[int], slots_per_rank: int
) -> list[tuple[int, int]]:
    """For each new physical slot: (source rank, source local slot) in the old placement."""
    if len(old_phy2log) != len(new_phy2log) or len(old_phy2log) % slots_per_rank:
        raise ValueError(
            f"plan_moves: old and new placements must have the same number of slots, a "
            f"multiple of slots_per_rank={slots_per_rank}; got {len(old_phy2log)} and "
            f"{len(new_phy2log)}"
        )
    holders: dict[int, list[int]] = {}
    for p, e in enumerate(old_phy2log):
        holders.setdefault(e, []).append(p)
    out = []
    for p, e in enumerate(new_phy2log):
        if e not in holders:
            raise ValueError(f"plan_moves: logical expert {e} is in no slot of the old placement")
        rank = p // slots_per_rank
        here = [q for q in holders[e] if q // slots_per_rank == rank]
        src = here[0] if here else holders[e][0]
        out.append((src // slots_per_rank, src % slots_per_rank))
    return out


def exchange_experts(
    stacks: Sequence[torch.Tensor],
    moves: Sequence[tuple[int, int]],
    rank: int,
    group: dist.ProcessGroup | None,
) -> list[torch.Tensor]:
    """This rank's new local stacks after `moves` (from `plan_moves`).

    stacks: this rank's current local tensors, each [S, ...] (S slots; e.g. the FP4 weights and
    scales of w1, w3, w2); rank: this rank's index in the EP `group` (None: a single rank).
    Returns new tensors of the same shapes and dtypes, in the same order.
    """
    s = stacks[0].shape[0]
    world = len(moves) // s
    per_row = [t[0].numel() * t.element_size() for t in stacks]

    def pack(local_slots: list[int]) -> torch.Tensor:
        if not local_slots:
            return stacks[0].new_empty(0, sum(per_row), dtype=torch.uint8)
        idx = torch.tensor(local_slots, dtype=torch.int64, device=stacks[0].device)
        parts = [t.index_select(0, idx).reshape(len(local_slots), -1).view(torch.uint8)
                 for t in stacks]  # fmt: skip
        return torch.cat(parts, dim=1)

    # what this rank sends to each destination, in the destination's slot order
    send_slots: list[int] = []
    send_counts = [0] * world
    recv_counts = [0] * world
    for p, (src_rank, src_slot) in enumerate(moves):
        dst = p // s
        if src_rank == rank:
            send_slots.append(src_slot)
            send_counts[dst] += 1
        if dst == rank:
            recv_counts[src_rank] += 1
    send = pack(send_slots)  # destination-major, each destination's slots in order
    recv = send.new_empty(s, sum(per_row))
    if group is None:
        recv.copy_(send)
    else:
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    # received rows arrive grouped by source rank, each group in this rank's slot order
    mine = [(src_rank, p % s) for p, (src_rank, _) in enumerate(moves) if p // s == rank]
    arrival = sorted(range(s), key=lambda i: (mine[i][0], i))
    row_of_slot = [0] * s
    for row, i in enumerate(arrival):
        row_of_slot[i] = row
    rows = recv[torch.tensor(row_of_slot, dtype=torch.int64, device=recv.device)]
    out, o = [], 0
    for t, nb in zip(stacks, per_row, strict=True):
        out.append(rows[:, o : o + nb].contiguous().view(t.dtype).reshape(t.shape))
        o += nb
    return out
