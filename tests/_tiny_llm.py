"""An `LLM` over the built-in tiny checkpoint, as the cross-package tests build it: fp32 on
the CPU, 8-token pages; `**kw` overrides these or sets any other engine argument."""

from __future__ import annotations

from deepinfer import LLM


def tiny_llm(**kw) -> LLM:
    settings = dict(
        accelerator="cpu",
        dtype="float32",
        kv_cache_bytes=32 << 20,
        max_num_seqs=4,
        block_size=8,
        max_model_len=128,
    )
    return LLM(**{**settings, **kw})
