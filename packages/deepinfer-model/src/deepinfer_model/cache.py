"""The KV cache pools of the V4.1 model (tensors owned here; bookkeeping owned by the engine).

Paged part (indexed through `block_tables`): for every kv-source layer with ratio r, the
compressed KV ``[num_blocks, block_size // r, head_dim]`` and the index keys
``[num_blocks, block_size // r, index_head_dim]``; entry j of a sequence (covering positions
j*r .. j*r+r-1) lives on page ``block_tables[b, j*r // block_size]`` at row
``(j*r % block_size) // r``.

Per-slot part (indexed by `slots`): for every layer and DSpark stage a sliding-window ring
``[num_slots, window + 8, head_dim]`` (position p at row p % ring); for ratio>1 compressors the
projected kv / gate logits of recent positions ``[num_slots, r + 8, head_dim]`` fp32 (so a
group split across steps can be pooled, and rolled back); the Engram compressed-token history
``[num_slots, max_ngram - 1 + 8]`` int64. Every ring is indexed by absolute position, so rolling
a sequence back by up to 7 tokens (rejected draft tokens) needs no undo: later steps overwrite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig

ROLLBACK = 8
"""Extra ring rows beyond what one step needs, so a verify of up to 7 drafts can be undone."""


def _ratio_of_sources(config: ModelConfig) -> dict[int, int]:
    return {s: config.compress_ratios[s] for s in config.kv_source_layer_ids}


@dataclass(frozen=True)
class CacheSpec:
    """Sizes the engine needs to budget the cache.

    block_size: tokens per page (a multiple of every compress ratio); bytes_per_block: all paged
    tensors of one page over all layers; bytes_per_slot: one sequence's fixed state.
    """

    block_size: int
    bytes_per_block: int
    bytes_per_slot: int
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def from_config(
        cls, config: ModelConfig, block_size: int = 64, dtype: torch.dtype = torch.bfloat16
    ) -> CacheSpec:
        ratios = _ratio_of_sources(config)
        for s, r in ratios.items():
            if block_size <= 0 or block_size % r:
                raise ValueError(
                    f"block_size: {block_size} must be a positive multiple of layer {s}'s ratio {r}"
                )
        el = torch.empty((), dtype=dtype).element_size()
        per_block = sum(
            (block_size // r) * (config.head_dim + config.index_head_dim) * el
            for r in ratios.values()
        )
        ring = config.swa_ring_len * config.head_dim * el * config.num_layers_total
        comp = sum((r + ROLLBACK) * config.head_dim * 4 * 2 for r in ratios.values() if r > 1)
        eng = (config.engram_max_ngram_size - 1 + ROLLBACK) * 8 if config.engram_layer_ids else 0
        return cls(block_size, per_block, ring + comp + eng, dtype)


class KVCache:
    """Allocates the pools described in the module docstring.

    `swa[l]` for l in 0..num_layers_total-1 (DSpark stages after the backbone);
    `compressed_kv[src]`, `index_k[src]`, `comp_kv[src]`, `comp_score[src]` keyed by kv-source
    layer; `engram_history`.
    """

    def __init__(
        self,
        config: ModelConfig,
        spec: CacheSpec,
        num_blocks: int,
        num_slots: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
        if num_slots < 1:
            raise ValueError(f"num_slots: must be >= 1, got {num_slots}")
        self.config, self.spec = config, spec
        self.block_size = spec.block_size
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.device = torch.device(device)
        self.dtype = dtype or spec.dtype
        hd, idd = config.head_dim, config.index_head_dim
        self.ring_len = config.swa_ring_len
        self.swa = [
            torch.zeros(num_slots, self.ring_len, hd, dtype=self.dtype, device=self.device)
            for _ in range(config.num_layers_total)
        ]
        self.compressed_kv: dict[int, torch.Tensor] = {}
        self.index_k: dict[int, torch.Tensor] = {}
        self.comp_kv: dict[int, torch.Tensor] = {}
        self.comp_score: dict[int, torch.Tensor] = {}
        for s, r in _ratio_of_sources(config).items():
            rows = self.block_size // r
            self.compressed_kv[s] = torch.zeros(
                num_blocks, rows, hd, dtype=self.dtype, device=self.device
            )
            self.index_k[s] = torch.zeros(
                num_blocks, rows, idd, dtype=self.dtype, device=self.device
            )
            if r > 1:
                shape = (num_slots, r + ROLLBACK, hd)
                self.comp_kv[s] = torch.zeros(shape, dtype=torch.float32, device=self.device)
                self.comp_score[s] = torch.full(
                    shape, float("-inf"), dtype=torch.float32, device=self.device
                )
        self.engram_hist_len = config.engram_max_ngram_size - 1 + ROLLBACK
        self.engram_history = torch.zeros(
            num_slots, self.engram_hist_len, dtype=torch.int64, device=self.device
        )

    def reset_slot(self, slot: int) -> None:
        """Clear a slot's fixed state for a new sequence (pages are the engine's to reuse)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot: {slot} is not in [0, {self.num_slots})")
        for ring in self.swa:
            ring[slot].zero_()
        for t in self.comp_kv.values():
            t[slot].zero_()
        for t in self.comp_score.values():
            t[slot].fill_(float("-inf"))
        self.engram_history[slot].zero_()
