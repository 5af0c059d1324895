"""The V4.1 tokenizer: a thin, typed wrapper over `tokenizers.Tokenizer` (`tokenizer.json`).

DeepSeek ships `tokenizer.json` (a byte-level BPE) plus `tokenizer_config.json` (which names the
BOS/EOS strings) and no Jinja chat template: prompts are built by `deepinfer_model.chat`.
Special tokens are *added tokens* of the backend, so a chat prompt string containing
`<｜User｜>` etc. encodes to the special ids directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import tokenizers

# ---- the V4.1 special tokens (reference §4) -------------------------------------------------
# Note the full-width bar "｜" (U+FF5C) and the "▁" (U+2581) in the sentence tokens: these are
# the exact strings of DeepSeek's vocabulary, not ASCII look-alikes.
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SYSTEM_TOKEN = "<｜System｜>"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
DSML_TOKEN = "｜DSML｜"
# Task tokens: internal classification tasks of the V4.1 encoding; never emitted by plain chat.
TASK_TOKENS = (
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
)

V41_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    SYSTEM_TOKEN,
    LATEST_REMINDER_TOKEN,
    IMAGE_TOKEN,
    THINK_START_TOKEN,
    THINK_END_TOKEN,
    DSML_TOKEN,
    *TASK_TOKENS,
)
"""Every V4.1 special token, BOS first and EOS second (ids 0 and 1 in DeepSeek's vocabulary)."""


def _token_string(entry: object, field: str, path: Path) -> str | None:
    """`tokenizer_config.json` stores a token either as a string or as {"content": ...}."""
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    raise ValueError(
        f"{path}: field {field!r} must be a string or {{'content': str}}, got {entry!r}"
    )


class Tokenizer:
    """Text <-> token ids for V4.1 checkpoints.

    `encode` never adds BOS (the chat encoding writes BOS into the prompt string itself);
    `decode` drops special tokens by default. `backend` is the `tokenizers.Tokenizer` for callers
    that need offsets or batch encoding.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: str = BOS_TOKEN,
        eos_token: str = EOS_TOKEN,
    ) -> None:
        self.backend = backend
        bos_id = backend.token_to_id(bos_token)
        eos_id = backend.token_to_id(eos_token)
        if bos_id is None:
            raise ValueError(f"bos_token {bos_token!r} is not in the tokenizer vocabulary")
        if eos_id is None:
            raise ValueError(f"eos_token {eos_token!r} is not in the tokenizer vocabulary")
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int = bos_id
        self.eos_token_id: int = eos_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        """The ids `decode` drops with skip_special_tokens (V4.1: BOS, EOS, PAD; the role,
        think, DSML, task and image markers are ordinary added tokens)."""

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json` when present) from a checkpoint dir."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        bos, eos = BOS_TOKEN, EOS_TOKEN
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            bos = _token_string(cfg.get("bos_token"), "bos_token", cfg_file) or bos
            eos = _token_string(cfg.get("eos_token"), "eos_token", cfg_file) or eos
        return cls(backend, bos_token=bos, eos_token=eos)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in `text` map to their ids; no BOS added."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(
        self,
        ids: Iterable[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Text of `ids`; special tokens (`special_ids`) are dropped unless
        `skip_special_tokens=False`, and then, with `spaces_between_special_tokens` (vLLM's
        default), each is separated from its neighbours by one space, as Hugging Face's slow
        tokenizers join the pieces."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        if skip_special_tokens or not spaces_between_special_tokens:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces, run = [], []
        for i in ids:
            if i in self.special_ids:
                if run:
                    pieces.append(self.backend.decode(run, skip_special_tokens=False))
                    run = []
                pieces.append(self.backend.decode([i], skip_special_tokens=False))
            else:
                run.append(i)
        if run:
            pieces.append(self.backend.decode(run, skip_special_tokens=False))
        return " ".join(pieces)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of one id (byte-level form, e.g. 'Ġ' for a space)."""
        token_id = int(token_id)
        token = self.backend.id_to_token(token_id) if token_id >= 0 else None
        if token is None:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        return token

    def token_to_id(self, token: str) -> int:
        """The id of a vocabulary string (e.g. a special token); ValueError if absent."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the tokenizer vocabulary")
        return token_id

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_id={self.eos_token_id})"
        )
