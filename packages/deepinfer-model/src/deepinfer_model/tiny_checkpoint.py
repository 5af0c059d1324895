"""The built-in tiny V4.1 checkpoint: written once by package code, loaded like the real one.

`ensure_tiny_checkpoint()` returns a directory in the Hugging Face layout:

    config.json                    text_config (ModelConfig.tiny()) + a small vision_config
    tokenizer.json                 byte level: BOS/EOS/PAD, V4.1 special tokens, 256 bytes
    tokenizer_config.json          names BOS / EOS / PAD
    model.safetensors.index.json   metadata.total_size + weight_map
    model-0000{1,2}-of-00002.safetensors

under ``$XDG_CACHE_HOME/deepinfer/tiny-v41-<version>`` (``~/.cache`` when unset). `<version>`
is the format version plus a fingerprint of the config and of the model's parameter names,
shapes and dtypes, so a changed model never loads a stale checkpoint.

Weights are in the real formats: dense projections FP8 e4m3 with 32x32 UE8M0 block scales,
experts FP4 e2m1 (two per byte) with UE8M0 scales per 32 along K, embeddings/head/norms BF16,
mHC parameters and sinks FP32 (each tensor in the dtype the model declares for it). Values
come from a CPU `torch.Generator` seeded per tensor from (seed, name), so each tensor is
independent of the others and of their order, and the files are byte-identical on every
machine and every run (a checksum test holds this).

A few small `vision.*` / `aligner.*` / `image_*` tensors are included, as in the released
checkpoint, so the loader's "skip vision weights" path runs on every tiny load.
"""

from __future__ import annotations

from deepinfer_model.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    DSML_TOKEN,
    EOS_TOKEN,
    IMAGE_TOKEN,
    LATEST_REMINDER_TOKEN,
    SYSTEM_TOKEN,
    TASK_TOKENS,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
)

TINY_FORMAT_VERSION = 1
"""Bump when the generation rules change; part of the cache directory name."""
TINY_SEED = 20260917
NUM_SHARDS = 2
PAD_TOKEN = "<｜▁pad▁｜>"

# Id order of the tiny vocabulary: BOS=0, EOS=1, PAD=2 as in DeepSeek's vocabulary (the Engram
# pad id is 2), then the other special tokens, then the 256 byte tokens.
TINY_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
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
# Dropped by decode(skip_special_tokens=True); the role, think, DSML and task markers stay
# visible in decoded text (DeepSeek marks them non-special so that parsers can see them).
_SKIPPED_ON_DECODE = {BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IMAGE_TOKEN}


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def byte_level_alphabet() -> dict[int, str]:
    """The byte-level BPE alphabet: byte -> printable char (printable Latin-1 bytes map to
    themselves, the other 68 bytes to U+0100.. in byte order), as GPT-2-style tokenizers use."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


def build_tiny_tokenizer():
    """A byte-level `tokenizers.Tokenizer`: the special tokens at ids 0.., then 256 bytes."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    for b, ch in byte_level_alphabet().items():
        vocab[ch] = len(TINY_SPECIAL_TOKENS) + b
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # Both kinds are matched whole in input text; only `special` ones are dropped on decode.
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in TINY_SPECIAL_TOKENS
            if t in _SKIPPED_ON_DECODE
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t in TINY_SPECIAL_TOKENS
            if t not in _SKIPPED_ON_DECODE
        ]
    )
    return backend


def tiny_tokenizer_config() -> dict:
    """`tokenizer_config.json` of the tiny checkpoint."""
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
