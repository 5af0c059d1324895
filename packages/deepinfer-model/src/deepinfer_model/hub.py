"""Where a checkpoint lives: a local directory or a Hugging Face hub repo id.

A hub repo is fetched with `huggingface_hub.snapshot_download(allow_patterns=...)`, so only the
files the text model needs are downloaded (configs, tokenizer, safetensors shards); the usual
`HF_HOME` / `HF_HUB_CACHE` / `HF_HUB_OFFLINE` / `HF_TOKEN` variables are honoured by
huggingface_hub itself. The only variable read here is `XDG_CACHE_HOME` (`user_cache_dir`):
deepinfer's own settings come in as arguments (the engine resolves `DEEPINFER_HF_MODEL_DIR`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

TEXT_MODEL_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
"""The files a text-only load needs (no `inference/`, no images, no pickles)."""

# owner/name as the hub spells it: letters, digits, '-', '_', '.'; one slash.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def resolve_checkpoint(
    source: str | os.PathLike,
    *,
    allow_patterns: Sequence[str] = TEXT_MODEL_PATTERNS,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> Path:
    """The local directory of checkpoint `source`.

    `source` is an existing directory, or a hub repo id `owner/name` (optionally pinned with
    `revision`), which is downloaded (or found in the hub cache) via `snapshot_download`.
    Raises FileNotFoundError when `source` is neither an existing directory nor a repo id that
    the hub (or its cache, offline) can provide.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    text = os.fspath(source)
    if not _REPO_ID.match(text):
        raise FileNotFoundError(
            f"checkpoint source {text!r} is not an existing directory and not a hub repo id "
            "of the form 'owner/name'"
        )
    # Imported here: huggingface_hub reads its env (HF_HUB_OFFLINE, ...) at import time, and a
    # purely local load should not pay for or depend on it.
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            repo_id=text,
            revision=revision,
            allow_patterns=list(allow_patterns),
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            local_files_only=local_files_only,
        )
    except Exception as e:  # offline miss, unknown repo, network: say what was tried
        raise FileNotFoundError(
            f"checkpoint source {text!r} is not a local directory, and fetching it as a hub "
            f"repo id failed: {type(e).__name__}: {e}"
        ) from e
    return Path(local)


def user_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/deepinfer`, or `~/.cache/deepinfer` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepinfer"
