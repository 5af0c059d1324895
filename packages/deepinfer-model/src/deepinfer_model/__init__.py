"""deepinfer_model: DeepSeek-V4.1-Flash in PyTorch.

`ModelConfig` (config), `Model` (model; one `forward(ForwardBatch, KVCache)` for prefill,
chunked prefill, decode and verify), `KVCache`/`CacheSpec` (cache), `ForwardBatch`/
`ForwardOutput` and their builder `build_batch` (batch), the DSpark stages
(`dspark.dspark_step`), a loaded model as an engine runs it (`runtime.ModelRuntime`), and weight
loading / tokenizer / chat encoding / the built-in tiny checkpoint (loader, tokenizer, chat,
tiny_checkpoint). Heavy submodules are imported on attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "config",
    "Model": "model",
    "init_random_": "model",
    "KVCache": "cache",
    "CacheSpec": "cache",
    "ForwardBatch": "batch",
    "ForwardOutput": "batch",
    "SequenceInput": "batch",
    "build_batch": "batch",
    "ModelRuntime": "runtime",
    "DraftOutput": "dspark",
    "dspark_step": "dspark",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer_model' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
