"""Bookkeeping for V4.1's KV cache: per-sequence slots and paged blocks, sized from a byte budget.

The pool tensors belong to the model (`deepinfer_model.cache.KVCache`). Their shape here is two
numbers from the model's `CacheSpec`:
  * a *slot* (`bytes_per_slot`) is one running sequence's fixed-size state: the SWA ring of every
    layer, the compressors' partial state, the Engram token history;
  * a *block* (`bytes_per_block`) holds `block_size` token positions of every paged tensor
    (compressed KV and index keys of the KV-source layers).
A running sequence owns one slot and ceil(tokens_in_cache / block_size) blocks, listed in its
block table. When nothing is free the scheduler waits or preempts; this class never raises for
exhaustion, it answers `can_*` questions and hands out what it has.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from deepinfer_engine.sequence import Sequence

logger = logging.getLogger("deepinfer.engine")


@dataclass(frozen=True)
class CachePlan:
    """How a byte budget is split: `num_slots` slots, `num_blocks` pages, tokens of capacity."""

    num_slots: int
    num_blocks: int
    block_size: int
    max_model_len: int  # capped so that one sequence alone always fits

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_cache(
    budget_bytes: int,
    bytes_per_slot: int,
    bytes_per_block: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
) -> CachePlan:
    """Split `budget_bytes` into slots and blocks.

    Slots are only useful with pages to fill, so we keep enough blocks for one sequence of
    `max_model_len` tokens and give the rest to up to `max_num_seqs` slots, then everything left
    to blocks. If the budget cannot hold one full-length sequence, `max_model_len` is capped to
    what fits with a single slot (and logged), rather than failing later mid-run.
    """
    if bytes_per_slot < 0 or bytes_per_block <= 0:
        raise ValueError(
            f"bad CacheSpec: bytes_per_slot={bytes_per_slot}, bytes_per_block={bytes_per_block}"
        )
    blocks_one_seq = math.ceil(max_model_len / block_size)
    rest = budget_bytes - blocks_one_seq * bytes_per_block
    if bytes_per_slot > 0:
        num_slots = max(1, min(max_num_seqs, rest // bytes_per_slot if rest > 0 else 1))
    else:
        num_slots = max_num_seqs
    num_blocks = (budget_bytes - num_slots * bytes_per_slot) // bytes_per_block
    if num_blocks < 1:
        need = bytes_per_slot + bytes_per_block
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes is too small: one sequence needs at least "
            f"{need} bytes (1 slot + 1 block of {block_size} tokens); raise kv_cache_bytes "
            f"(CPU) or gpu_memory_utilization (GPU)"
        )
    capped = min(max_model_len, num_blocks * block_size)
    if capped < max_model_len:
        logger.warning(
            "KV cache holds %d tokens; max_model_len capped from %d to %d",
            num_blocks * block_size,
            max_model_len,
            capped,
        )
    return CachePlan(num_slots, num_blocks, block_size, capped)


class KVCacheManager:
    """Free lists of slots and blocks; block tables live on the sequences."""

    def __init__(self, num_slots: int, num_blocks: int, block_size: int) -> None:
        if num_slots < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_slots={num_slots}, num_blocks={num_blocks}, block_size={block_size} "
                "must all be >= 1"
            )
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Lowest id first keeps allocations deterministic (same ids for the same schedule).
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_blocks = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs so positions up to num_computed + num_new_tokens have pages."""
        total = math.ceil((seq.num_computed_tokens + num_new_tokens) / self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """True if `seq` can take `num_new_tokens` more tokens (and a slot, if it has none)."""
        if seq.slot < 0 and not self._free_slots:
            return False
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` a slot (if it has none) and the blocks for `num_new_tokens` more tokens.

        Returns True if the slot is new, so the caller resets its state before use.
        """
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError("allocate() without can_allocate(); scheduler bug")
        new_slot = seq.slot < 0
        if new_slot:
            seq.slot = self._free_slots.pop()
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._free_blocks.pop())
        return new_slot

    def free(self, seq: Sequence) -> None:
        """Return a sequence's slot and blocks (on finish or preemption)."""
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            seq.slot = -1
        self._free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []
