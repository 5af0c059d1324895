"""The EPLB rebalancing algorithm: which logical expert each physical expert slot holds.

Given the recent load of every logical expert, choose how many replicas each gets and on which GPU
each replica lives, so that the busiest GPU is as idle as possible. Two policies (facts in
``shared/reference/spec-and-parallel.md`` §4.1):

* **hierarchical** (needs ``num_groups % num_nodes == 0``; suits prefill, where the router limits
  each token to a few expert groups so keeping a group on one node keeps traffic intra-node):
  1. pack expert groups onto nodes by group load, an equal number of groups per node;
  2. inside each node, give the node's spare slots to its own experts (replication);
  3. pack the node's physical experts onto its GPUs, an equal number of slots per GPU.
* **global** (suits decode): the same with one group and one node, i.e. replicate over all
  experts and pack over all GPUs.

Both steps are greedy: replication gives each spare slot to the expert with the highest load per
replica; packing places items heaviest first into the lightest pack with a free slot. Greedy
packing is a heuristic and can, on small adversarial inputs, lose to the trivial contiguous
placement, so each layer's result is compared with the identity placement (expert ``e`` on GPU
``e // (logical / gpus)``, spare slots replicating experts already on that GPU) and the identity
wins if it has a strictly lower busiest GPU. Hence the guarantee: the max per-GPU load never
exceeds the identity placement's.

Slot numbering: physical slot ``p`` lives on GPU ``p // slots_per_gpu``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal

import torch

Policy = Literal["auto", "hierarchical", "global"]
POLICIES = ("auto", "hierarchical", "global")


@dataclass(frozen=True)
class ExpertPlacement:
    """Where each logical expert's replicas live, for every MoE layer.

    Attributes:
        phy2log: ``[layers, num_physical]`` int64, the logical expert held by each physical slot.
        log2phy: ``[layers, num_logical, max_replicas]`` int64, the physical slots holding each
            logical expert in ascending order, padded with ``-1``.
        logcnt: ``[layers, num_logical]`` int64, the replica count of each logical expert (>= 1).
        num_gpus: GPUs the slots are spread over; slot ``p`` lives on GPU
            ``p // (num_physical // num_gpus)``.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_gpus: int

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]

    @property
    def slots_per_gpu(self) -> int:
        return self.num_physical // self.num_gpus

    @property
    def max_replicas(self) -> int:
        return self.log2phy.shape[2]

    def gpu_load(self, load: torch.Tensor) -> torch.Tensor:
        """Expected per-GPU load ``[layers, num_gpus]`` float64 under this placement.

        Each logical expert's load ``load [layers, logical]`` is split evenly over its replicas
        (what hash routing achieves in expectation).
        """
        return placement_gpu_load(load, self.phy2log, self.logcnt, self.num_gpus)


def placement_gpu_load(
    load: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int
) -> torch.Tensor:
    """Per-GPU load ``[layers, num_gpus]`` float64 for ``phy2log [layers, P]`` and ``logcnt``.

    Each slot carries ``load[e] / logcnt[e]`` for the logical expert ``e`` it holds.
    """
    load64 = load.to(torch.float64)
    per_replica = load64 / logcnt.to(torch.float64)  # [layers, logical]
    slot_load = torch.gather(per_replica, 1, phy2log)  # [layers, P]
    return slot_load.reshape(phy2log.shape[0], num_gpus, -1).sum(dim=2)


def balanced_packing(weights: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items.

    Items are taken heaviest first (ties: lower index first) and each goes into the currently
    lightest pack that still has room (ties: lower pack index).

    Returns:
        ``(pack_of_item, rank_in_pack)``, two lists of length ``n``.
    """
    n = len(weights)
    if num_packs <= 0 or n % num_packs != 0:
        raise ValueError(f"item count ({n}) must be divisible by num_packs ({num_packs})")
    capacity = n // num_packs
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    heap = [(0.0, pack) for pack in range(num_packs)]  # (current load, pack index)
    filled = [0] * num_packs
    pack_of = [0] * n
    rank_of = [0] * n
    for item in order:
        pack_load, pack = heapq.heappop(heap)
        pack_of[item] = pack
        rank_of[item] = filled[pack]
        filled[pack] += 1
        if filled[pack] < capacity:  # a full pack leaves the heap for good
            heapq.heappush(heap, (pack_load + weights[item], pack))
    return pack_of, rank_of


def replicate_experts(weights: list[float], num_slots: int) -> tuple[list[int], list[int]]:
    """Fill ``num_slots >= n`` slots with the ``n`` items, each at least once.

    Each spare slot goes to the item with the highest weight per replica (ties: lower index),
    which greedily minimises the max per-replica weight.

    Returns:
        ``(item_of_slot, count)``: ``item_of_slot`` has length ``num_slots`` (slot ``i < n``
        holds item ``i``; spare slots follow in the order they were given out), ``count`` has
        length ``n``.
    """
    n = len(weights)
    if num_slots < n:
        raise ValueError(f"num_slots ({num_slots}) must be >= the number of items ({n})")
    count = [1] * n
    item_of_slot = list(range(n))
    heap = [(-weights[i], i) for i in range(n)]  # (-weight per replica, item)
    heapq.heapify(heap)
    for _ in range(num_slots - n):
        _, item = heapq.heappop(heap)
        item_of_slot.append(item)
        count[item] += 1
        heapq.heappush(heap, (-weights[item] / count[item], item))
    return item_of_slot, count


def _place_layer(
    w: list[float], num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> list[int]:
    """One layer of the hierarchical algorithm (global = one group, one node). Returns phy2log."""
    n = len(w)
    group_size = n // num_groups
    slots_per_node = num_physical // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_physical // num_gpus

    group_w = [sum(w[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_of_group, rank_of_group = balanced_packing(group_w, num_nodes)

    phy2log = [-1] * num_physical
    for node in range(num_nodes):
        groups = sorted(
            (g for g in range(num_groups) if node_of_group[g] == node),
            key=lambda g: rank_of_group[g],
        )
        experts = [g * group_size + i for g in groups for i in range(group_size)]
        local_w = [w[e] for e in experts]
        item_of_slot, count = replicate_experts(local_w, slots_per_node)
        replica_w = [local_w[it] / count[it] for it in item_of_slot]
        gpu_of, rank_of = balanced_packing(replica_w, gpus_per_node)
        for j, it in enumerate(item_of_slot):
            gpu = node * gpus_per_node + gpu_of[j]
            phy2log[gpu * slots_per_gpu + rank_of[j]] = experts[it]
    return phy2log


def _identity_layer(w: list[float], num_physical: int, num_gpus: int) -> list[int]:
    """Expert ``e`` on GPU ``e // (n / gpus)``; each GPU's spare slots replicate its own experts.

    Replicas on the same GPU do not change its load, so the per-GPU load equals that of the plain
    identity placement without redundancy. Needs ``n % num_gpus == 0``.
    """
    n = len(w)
    per_gpu = n // num_gpus
    slots_per_gpu = num_physical // num_gpus
    phy2log: list[int] = []
    for gpu in range(num_gpus):
        experts = list(range(gpu * per_gpu, (gpu + 1) * per_gpu))
        item_of_slot, _ = replicate_experts([w[e] for e in experts], slots_per_gpu)
        phy2log.extend(experts[it] for it in item_of_slot)
    return phy2log


def _max_gpu_load(w: list[float], phy2log: list[int], num_gpus: int) -> float:
    count: dict[int, int] = {}
    for e in phy2log:
        count[e] = count.get(e, 0) + 1
    slots_per_gpu = len(phy2log) // num_gpus
    return max(
        sum(w[e] / count[e] for e in phy2log[g * slots_per_gpu : (g + 1) * slots_per_gpu])
        for g in range(num_gpus)
    )


def _check_inputs(
    load: torch.Tensor,
    num_physical_experts: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    policy: str,
) -> str:
    """Validate the inputs; return the resolved policy ("hierarchical" or "global")."""
    if load.dim() != 2:
        raise ValueError(f"load must be [layers, logical_experts], got shape {list(load.shape)}")
    num_logical = load.shape[1]
    if num_logical == 0 or load.shape[0] == 0:
        raise ValueError(f"load must have >= 1 layer and >= 1 expert, got {list(load.shape)}")
    if load.dtype == torch.bool or load.is_complex():
        raise ValueError(f"load must be a real numeric tensor, got dtype {load.dtype}")
    load64 = load.to(torch.float64)
    if not bool(torch.isfinite(load64).all()) or bool((load64 < 0).any()):
        raise ValueError("load must be finite and >= 0 (token counts)")
    for name, value in (
        ("num_physical_experts", num_physical_experts),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_gpus", num_gpus),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if num_physical_experts < num_logical:
        raise ValueError(
            f"num_physical_experts ({num_physical_experts}) must be >= the number of logical "
            f"experts ({num_logical}): every logical expert needs at least one slot"
        )
    if num_physical_experts % num_gpus != 0:
        raise ValueError(
            f"num_physical_experts ({num_physical_experts}) must be divisible by num_gpus "
            f"({num_gpus}) so that every GPU gets the same number of slots"
        )
    if num_gpus % num_nodes != 0:
        raise ValueError(f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes})")
    if num_logical % num_groups != 0:
        raise ValueError(
            f"the number of logical experts ({num_logical}) must be divisible by num_groups "
            f"({num_groups})"
        )
    groups_fit = num_groups % num_nodes == 0
    if policy == "hierarchical" and not groups_fit:
        raise ValueError(
            f"policy='hierarchical' needs num_groups ({num_groups}) divisible by num_nodes "
            f"({num_nodes}); use policy='global' or 'auto'"
        )
    if policy == "auto":
        return "hierarchical" if groups_fit else "global"
    return policy


def rebalance_experts(
    load: torch.Tensor,
    num_physical_experts: int,
    num_groups: int = 1,
    num_nodes: int = 1,
    num_gpus: int = 1,
    policy: Policy = "auto",
) -> ExpertPlacement:
    """Choose replica counts and slots for every logical expert of every MoE layer.

    Args:
        load: ``[layers, num_logical]`` recent token counts per logical expert (any real dtype,
            finite, >= 0), e.g. :meth:`ExpertLoadWindow.load`.
        num_physical_experts: total expert slots over all GPUs (logical + redundant), divisible
            by ``num_gpus`` and >= ``num_logical``.
        num_groups: expert groups (the router's group-limited routing), dividing ``num_logical``.
        num_nodes: nodes; must divide ``num_gpus`` (and ``num_groups`` for ``"hierarchical"``).
        num_gpus: GPUs holding expert slots.
        policy: ``"hierarchical"``, ``"global"``, or ``"auto"`` (hierarchical when
            ``num_groups % num_nodes == 0``, else global).

    Returns:
        An :class:`ExpertPlacement` with ``phy2log [layers, P]``, ``log2phy [layers, N,
        max_replicas]`` (-1 padded), ``logcnt [layers, N]``, all int64 on the CPU.

    Raises:
        ValueError: naming the unsatisfiable input (slots not divisible by GPUs, fewer slots than
            experts, groups not divisible by nodes for the hierarchical policy, ...).
    """
    resolved = _check_inputs(load, num_physical_experts, num_groups, num_nodes, num_gpus, policy)
    if resolved == "global":
        num_groups, num_nodes = 1, 1
    num_logical = load.shape[1]
    weights = load.detach().to("cpu", torch.float64).tolist()
    identity_possible = num_logical % num_gpus == 0

    rows: list[list[int]] = []
    for w in weights:
        phy2log = _place_layer(w, num_physical_experts, num_groups, num_nodes, num_gpus)
        if identity_possible:
            ident = _identity_layer(w, num_physical_experts, num_gpus)
            if _max_gpu_load(w, ident, num_gpus) < _max_gpu_load(w, phy2log, num_gpus):
                phy2log = ident
        rows.append(phy2log)

    return _placement(rows, num_logical, num_gpus)


def _placement(rows: list[list[int]], num_logical: int, num_gpus: int) -> ExpertPlacement:
    """The placement whose layer ``l`` puts logical expert ``rows[l][p]`` in slot ``p``."""
    num_layers = len(rows)
    phy2log_t = torch.tensor(rows, dtype=torch.int64)  # [layers, P]
    logcnt = torch.zeros(num_layers, num_logical, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log_t, torch.ones_like(phy2log_t))
    max_replicas = int(logcnt.max())
    log2phy_rows: list[list[list[int]]] = []
    for row in rows:
        slots: list[list[int]] = [[] for _ in range(num_logical)]
        for slot, e in enumerate(row):  # ascending slot order per expert
            slots[e].append(slot)
        log2phy_rows.append([s + [-1] * (max_replicas - len(s)) for s in slots])
    log2phy = torch.tensor(log2phy_rows, dtype=torch.int64)  # [layers, N, max_replicas]
    return ExpertPlacement(phy2log=phy2log_t, log2phy=log2phy, logcnt=logcnt, num_gpus=num_gpus)


def initial_placement(
    num_layers: int, num_logical: int, num_physical: int, num_gpus: int
) -> ExpertPlacement:
    """The placement before any load is known: expert ``e`` on GPU ``e // (logical / gpus)``
    with each GPU's spare slots replicating its own experts (the identity placement) when the
    experts divide evenly over the GPUs, else a balanced packing of equal loads."""
    flat = torch.ones(num_layers, num_logical)
    _check_inputs(flat, num_physical, 1, 1, num_gpus, "global")
    if num_logical % num_gpus:
        return rebalance_experts(flat, num_physical, num_gpus=num_gpus, policy="global")
    row = _identity_layer([0.0] * num_logical, num_physical, num_gpus)
    return _placement([list(row) for _ in range(num_layers)], num_logical, num_gpus)


def identity_gpu_load(load: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Per-GPU load ``[layers, num_gpus]`` float64 of the identity placement without redundancy.

    Expert ``e`` on GPU ``e // (num_logical / num_gpus)``; needs ``num_logical % num_gpus == 0``.
    """
    num_layers, num_logical = load.shape
    if num_gpus <= 0 or num_logical % num_gpus != 0:
        raise ValueError(
            f"identity placement needs num_logical ({num_logical}) divisible by num_gpus "
            f"({num_gpus})"
        )
    return load.to(torch.float64).reshape(num_layers, num_gpus, -1).sum(dim=2)
