"""A loaded V4.1 model as an engine runs it (`ModelRuntime`).

It has the shape of the engine's `EngineModel` protocol (structural typing: this package does not
import the engine): one forward per step, the cache's sizes and tensors, CUDA-graph decode, and
the facts the engine plans with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .batch import ForwardBatch, ForwardOutput
from .cache import CacheSpec, KVCache
from .config import ModelConfig
from .cuda_graph import DecodeGraphs


@dataclass
class ModelRuntime:
    """`model` (a `deepinfer_model.model.Model` or anything with its forward) under `config`,
    with its `tokenizer`; `name` is what the engine logs (the checkpoint path)."""

    model: Any
    config: ModelConfig
    tokenizer: Any
    name: str = "model"

    @classmethod
    def from_loaded(cls, loaded: Any) -> ModelRuntime:
        """Wrap a `deepinfer_model.loader.LoadedModel`."""
        return cls(loaded.model, loaded.config, loaded.tokenizer, str(loaded.path))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.config.eos_token_id

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def sliding_window(self) -> int:
        return self.config.sliding_window

    @property
    def supports_yoco_floor(self) -> bool:
        """The forward honours `ForwardBatch.yoco_floor` (YOCO prefill truncation): the
        config's kv sources all lie at or before the decoder start (V4.1: 2, 8, 14, 20)."""
        cfg = self.config
        return all(src <= cfg.decoder_start_layer for src in cfg.kv_source_layer_ids)

    @property
    def has_dspark_stages(self) -> bool:
        return self.config.num_nextn_predict_layers > 0

    @property
    def max_draft_tokens(self) -> int:
        """Tokens the DSpark stages draft per step: one block (`dspark_block_size`, 5 on V4.1),
        0 without stages."""
        return self.config.dspark_block_size if self.has_dspark_stages else 0

    def forward(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        return self.model.forward(batch, cache)

    def idle_forward(self, rows: int) -> None:
        """A sharded model's collectives of one step with no tokens (`Model.idle_forward`)."""
        self.model.idle_forward(rows)

    def end_step(self) -> bool:
        """After each engine step of a sharded model: online EPLB (`Model.end_step`)."""
        return self.model.end_step()

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> CacheSpec:
        return CacheSpec.from_config(self.config, block_size=block_size, dtype=dtype)

    def make_cache(
        self,
        spec: CacheSpec,
        num_blocks: int,
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> KVCache:
        return KVCache(self.config, spec, num_blocks, num_slots, device=device, dtype=dtype)

    def decode_graphs(self, max_batch: int) -> DecodeGraphs | None:
        return DecodeGraphs(self.model, max_batch)
