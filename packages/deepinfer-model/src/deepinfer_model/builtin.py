"""The built-in model: a tiny V4.1 checkpoint trained for real, shipped as package data.

`builtin_checkpoint()` is its directory inside the installed package, in the Hugging Face
layout (`config.json`, `generation_config.json`, `model.safetensors.index.json` + 2 shards,
`tokenizer.json`, `tokenizer_config.json`); `loader.load_model(None)` (and so `LLM()`) loads
it when `$DEEPINFER_HF_MODEL_DIR` is unset. It has every V4.1 layer kind (window-only layers,
ratio-2 and ratio-1 compressors, index sources with top-k, candidate blocks and a re-index
layer, reuse layers, the encoder/decoder split, Engram at two layers, MoE with a shared expert,
single-pass mHC) and two DSpark stages drafting 5 tokens, with a calibrated confidence head.
It was trained by `tools/train_tiny.py` on English prose and Python code (the corpus of
`tools/build_tiny_corpus.py`); the package README has its figures. The random-weight tiny
checkpoint (`tiny_checkpoint.ensure_tiny_checkpoint`) stays for tests that need its shapes.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUILTIN_PACKAGE_DIR = "data/tiny-v41"


def builtin_checkpoint() -> Path:
    """The directory of the built-in trained checkpoint (FileNotFoundError if the package was
    installed without its data)."""
    path = Path(str(resources.files("deepinfer_model") / BUILTIN_PACKAGE_DIR))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the built-in checkpoint is missing from {path}: reinstall deepinfer-model, or "
            "give a checkpoint (DEEPINFER_HF_MODEL_DIR or a model argument)"
        )
    return path
