"""The engine-model seam: what the engine needs from a model, whatever implements it.

Structural typing: a model package implements `EngineModel` without importing the engine
(`deepinfer_model.runtime.ModelRuntime` over a loaded V4.1 checkpoint; the engine tests' toy
model). The batch format is the model package's (`deepinfer_model.batch`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from deepinfer_model.batch import ForwardBatch, ForwardOutput

from deepinfer_engine.detokenizer import TokenDecoder


class TextTokenizer(TokenDecoder, Protocol):
    """encode(text) -> ids (no BOS added), and `TokenDecoder`'s decode. Structured output also
    reads `backend` (a `tokenizers.Tokenizer`) when a request asks for a grammar."""

    def encode(self, text: str) -> list[int]: ...


class CacheSizes(Protocol):
    """How the KV cache is budgeted: tokens per page, bytes of one page over all layers, bytes of
    one sequence's fixed per-slot state."""

    @property
    def block_size(self) -> int: ...

    @property
    def bytes_per_block(self) -> int: ...

    @property
    def bytes_per_slot(self) -> int: ...


class ModelCache(Protocol):
    """The cache tensors every forward reads and writes; a slot is reset when a sequence takes
    it."""

    def reset_slot(self, slot: int) -> None: ...


class DecodeGraphRunner(Protocol):
    """Runs pure decode steps through CUDA graphs: `forward` returns what the model's would."""

    def unsupported(self, batch: ForwardBatch) -> str | None:
        """Why `batch` cannot run graphed (None: it can), from host facts only."""
        ...

    def forward(self, batch: ForwardBatch, cache: Any) -> ForwardOutput: ...

    def bucket_for(self, n: int) -> int | None:
        """The padded batch size a decode step of `n` rows replays (None: too large)."""
        ...

    def capture_all(self) -> None:
        """Capture every bucket now (a sharded model's ranks, together, at start)."""
        ...


@runtime_checkable
class EngineModel(Protocol):
    """A model the engine can serve.

    Facts the engine plans with: `name` (logged), `tokenizer`, `vocab_size`, `eos_token_id`
    (None: no EOS), `max_position_embeddings`, `sliding_window` (tokens), and capabilities:
    `supports_yoco_floor` (the forward honours `ForwardBatch.yoco_floor`, needed by SWA bounded
    replay), `has_dspark_stages` (DSpark draft stages are loaded) and `max_draft_tokens` (the
    tokens its stages draft per step, 0 without: DEEPINFER_USE_NEXTN_DECODE's upper bound).
    """

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> TextTokenizer: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def sliding_window(self) -> int: ...

    @property
    def supports_yoco_floor(self) -> bool: ...

    @property
    def has_dspark_stages(self) -> bool: ...

    @property
    def max_draft_tokens(self) -> int: ...

    def forward(self, batch: ForwardBatch, cache: Any) -> ForwardOutput:
        """One step: logits [R, vocab] fp32 for `batch.logits_indices` (+ hidden if asked),
        writing the new tokens' state into `cache`."""
        ...

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> CacheSizes: ...

    def make_cache(
        self,
        spec: CacheSizes,
        num_blocks: int,
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> ModelCache:
        """The cache tensors for `num_blocks` pages and `num_slots` sequences on `device`."""
        ...

    def decode_graphs(self, max_batch: int) -> DecodeGraphRunner | None:
        """CUDA-graph decode for up to `max_batch` sequences (None: this model has none)."""
        ...


class ShardedEngineModel(EngineModel, Protocol):
    """One rank's part of a model sharded over several ranks: its forwards are collective
    (they pad to `ForwardBatch.collective_rows`), so a rank that scheduled nothing still takes
    part (`idle_forward`), and every rank closes each step together (`end_step`: online EPLB,
    True when the experts moved)."""

    def idle_forward(self, rows: int) -> None: ...

    def end_step(self) -> bool: ...
