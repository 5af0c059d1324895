"""A toy model that implements the engine's `EngineModel` protocol (ForwardBatch in,
ForwardOutput out, per-slot cache) so the engine is tested without the V4.1 model. Its next-token
logits are a float64 function of the whole token history *as read from its cache slot*, so an
engine bug that corrupts or skips cache state changes the tokens; `reference_logits(tokens)`
computes the same function from the plain token list, with no cache, for the independent greedy
loop of the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import tokenizers
import torch
from deepinfer_model.batch import ForwardBatch, ForwardOutput
from tokenizers import models, pre_tokenizers

CHARS = [*'abcdefghijklmnopqrstuvwxy {}[]":,.0123456789', "\n"]  # no "z"
SPECIALS = ["<bos>", "<eos>"]
VOCAB = [*SPECIALS, *CHARS]
EOS = 1
NAN_TOKEN = VOCAB.index("y")  # "y" at position 1 gives non-finite logits


def make_tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, "<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(SPECIALS)
    return tok


class ToyTokenizer:
    def __init__(self) -> None:
        self.backend = make_tokenizer()
        self.eos_token_id = EOS
        self.bos_token_id = 0
        self.vocab_size = len(VOCAB)

    def encode(self, text: str) -> list[int]:
        return [VOCAB.index(c) for c in text]

    def decode(
        self, ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        if skip_special_tokens:
            return "".join(VOCAB[i] for i in ids if i >= len(SPECIALS))
        if not spaces_between_special_tokens:
            return "".join(VOCAB[i] for i in ids)
        pieces = []  # each special token alone, the runs of other tokens between them
        for i in ids:
            if i < len(SPECIALS) or not pieces or pieces[-1] in SPECIALS:
                pieces.append(VOCAB[i])
            else:
                pieces[-1] += VOCAB[i]
        return " ".join(pieces)


def _weights(vocab: int, dim: int = 16):
    g = torch.Generator().manual_seed(1234)
    emb = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
    pos = torch.randn(11, dim, generator=g, dtype=torch.float64)
    out = torch.randn(dim, vocab, generator=g, dtype=torch.float64) * 3
    return emb, pos, out


_EMB, _POS, _OUT = _weights(len(VOCAB))
_SKIP = -3 * _POS[0]  # the "encoder-only" update of a skipped token


def reference_logits(tokens: list[int], encoder_only_below: int = 0) -> torch.Tensor:
    """[vocab] float64: the toy's next-token logits after `tokens` (no cache).

    Positions < `encoder_only_below` take the toy's "encoder-only" update (no position term),
    standing in for YOCO compact prefill's skipped decoder layers.
    """
    h = torch.zeros(_EMB.shape[1], dtype=torch.float64)
    for i, t in enumerate(tokens):
        h = 0.9 * h + _EMB[t] + (_SKIP if i < encoder_only_below else _POS[i % 11])
    logits = torch.tanh(h) @ _OUT
    if len(tokens) == 2 and tokens[-1] == NAN_TOKEN:
        logits = logits * float("nan")
    return logits


@dataclass
class ToyCache:
    """Per slot: the running state h [dim] and the last token; paged blocks are unused here."""

    h: torch.Tensor
    last: torch.Tensor
    n: torch.Tensor

    def reset_slot(self, slot: int) -> None:
        self.h[slot].zero_()
        self.last[slot] = -1
        self.n[slot] = 0


@dataclass(frozen=True)
class ToySpec:
    block_size: int
    bytes_per_block: int = 1024
    bytes_per_slot: int = 4096


class ToyModel:
    """The toy as an `EngineModel`: `max_len` positions, `bytes_per_slot` of state per sequence,
    `yoco`: whether it honours `ForwardBatch.yoco_floor`; `drafts`: the draft length it claims
    (the engine checks DEEPINFER_USE_NEXTN_DECODE against it; nothing drafts yet)."""

    name = "toy"
    eos_token_id = EOS
    vocab_size = len(VOCAB)
    sliding_window = 8

    def __init__(
        self, max_len: int = 256, bytes_per_slot: int = 4096, yoco: bool = False, drafts: int = 5
    ) -> None:
        self.tokenizer = ToyTokenizer()
        self.max_position_embeddings = max_len
        self.bytes_per_slot = bytes_per_slot
        self.supports_yoco_floor = yoco
        self.max_draft_tokens = drafts
        self.has_dspark_stages = drafts > 0
        self.truncations: set[str] = set()  # the yoco_truncation of batches with a floor

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> ToySpec:
        return ToySpec(block_size, bytes_per_slot=self.bytes_per_slot)

    def make_cache(self, spec, num_blocks, num_slots, device, dtype) -> ToyCache:
        return ToyCache(
            torch.zeros(num_slots, _EMB.shape[1], dtype=torch.float64),
            torch.full((num_slots,), -1),
            torch.zeros(num_slots, dtype=torch.int64),
        )

    def decode_graphs(self, max_batch: int) -> None:
        return None

    def forward(self, batch: ForwardBatch, cache: ToyCache) -> ForwardOutput:
        cu = batch.cu_seqlens.tolist()
        ids = batch.input_ids.tolist()
        pos = batch.positions.tolist()
        rows = {}
        for b in range(len(cu) - 1):
            slot = int(batch.slots[b])
            # the cache must continue exactly where the engine says it does
            assert int(cache.n[slot]) == int(batch.context_lens[b]), "cache/context mismatch"
            h = cache.h[slot].clone()
            floor = int(batch.yoco_floor[b]) if batch.yoco_floor is not None else 0
            for j in range(cu[b], cu[b + 1]):
                h = 0.9 * h + _EMB[ids[j]] + (_SKIP if pos[j] < floor else _POS[pos[j] % 11])
                logits = torch.tanh(h) @ _OUT
                if ids[j] == NAN_TOKEN and pos[j] == 1:
                    logits = logits * float("nan")
                rows[j] = logits
            cache.h[slot] = h
            cache.n[slot] += cu[b + 1] - cu[b]
        if batch.yoco_floor is not None:
            self.truncations.add(batch.yoco_truncation)
        sel = batch.logits_indices.tolist()
        logits = torch.stack([rows[j] for j in sel]).float() if sel else torch.empty(0, len(VOCAB))
        return ForwardOutput(logits=logits)


def greedy_reference(
    prompt: list[int], max_tokens: int, ignore_eos: bool = False, keep: int | None = None
) -> list[int]:
    """Plain greedy loop; `keep` = K of YOCO compact prefill (None: off)."""
    below = max(0, len(prompt) - keep) if keep is not None else 0
    toks, out = list(prompt), []
    for _ in range(max_tokens):
        t = int(torch.argmax(reference_logits(toks, below).float()))
        toks.append(t)
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out
