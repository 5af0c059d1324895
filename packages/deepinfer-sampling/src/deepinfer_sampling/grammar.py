"""Structured outputs with xgrammar: tokenizer info, compile cache, per-request matchers, bitmasks.

xgrammar imports transformers when it loads, so it is imported inside the functions that need it:
`import deepinfer_sampling` stays light, and only requests with a grammar pay for it.

Flow for one request: `GrammarCache(tokenizer_info).matcher(params.so_args)` gives a
`GrammarMatcher`; each step the engine calls `fill_bitmask(bitmask_cpu, row)` (via
`SamplingBatch.build`), the Sampler applies the bitmask on the logits' device
(`apply_token_bitmask`), and the engine calls `accept_token(token)` with the sampled token.
Speculative decoding accepts drafted tokens and `rollback(n)`s the rejected ones.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from .params import StructuredOutput, parse_grammar

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers
    import xgrammar

__all__ = [
    "GrammarCache",
    "GrammarMatcher",
    "Utf8Guard",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "bitmask_width",
    "tokenizer_info_from_tokenizer",
    "tokenizer_info_from_vocab",
]

VocabTypeName = Literal["raw", "byte_level", "byte_fallback"]
_VOCAB_TYPES = ("raw", "byte_level", "byte_fallback")


def tokenizer_info_from_vocab(
    vocab: Sequence[str | bytes],
    *,
    stop_token_ids: Sequence[int],
    vocab_type: VocabTypeName = "raw",
    vocab_size: int | None = None,
    add_prefix_space: bool = False,
) -> xgrammar.TokenizerInfo:
    """xgrammar TokenizerInfo from a plain vocabulary list (index = token id).

    vocab: token strings as the tokenizer stores them ("raw": the literal text or bytes of each
        token; "byte_level": GPT-2 style byte-to-unicode strings; "byte_fallback": "<0x0A>",
        "▁").
    stop_token_ids: ids that end generation (EOS etc.); a grammar accepts one of them at its end.
    vocab_size: the model's (possibly padded) logits width, >= len(vocab); ids past the vocab are
        never allowed by a grammar.
    """
    import xgrammar as xgr

    if vocab_type not in _VOCAB_TYPES:
        raise ValueError(f"vocab_type must be one of {_VOCAB_TYPES}, got {vocab_type!r}")
    if not stop_token_ids:
        raise ValueError("stop_token_ids must name at least one token id (e.g. EOS)")
    size = len(vocab) if vocab_size is None else vocab_size
    if size < len(vocab):
        raise ValueError(f"vocab_size must be >= len(vocab) = {len(vocab)}, got {size}")
    bad = [t for t in stop_token_ids if not 0 <= t < size]
    if bad:
        raise ValueError(f"stop_token_ids must be in [0, {size}), got {bad}")
    return xgr.TokenizerInfo(
        list(vocab),
        vocab_type=xgr.VocabType[vocab_type.upper()],
        vocab_size=size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=add_prefix_space,
    )


def tokenizer_info_from_tokenizer(
    tokenizer: tokenizers.Tokenizer,
    *,
    stop_token_ids: Sequence[int],
    vocab_size: int | None = None,
) -> xgrammar.TokenizerInfo:
    """xgrammar TokenizerInfo from a `tokenizers.Tokenizer` (e.g. `Tokenizer.from_file(
    "tokenizer.json")`), without transformers' tokenizer classes.

    The vocabulary type (byte-level, byte-fallback, raw) and add_prefix_space are detected from
    the tokenizer's JSON by xgrammar's own detector. stop_token_ids: EOS and friends (a
    `tokenizers.Tokenizer` does not know which token is EOS). vocab_size: the model's logits
    width if padded past the tokenizer's vocabulary.
    """
    import xgrammar as xgr

    vocab_dict = tokenizer.get_vocab(with_added_tokens=True)
    size = max(len(vocab_dict), max(vocab_dict.values()) + 1)
    if vocab_size is not None:
        if vocab_size < size:
            raise ValueError(f"vocab_size must be >= the tokenizer's {size}, got {vocab_size}")
        size = vocab_size
    encoded: list[str] = [""] * size
    for token, idx in vocab_dict.items():
        encoded[idx] = token
    # xgrammar's detector reads the serialized tokenizer.json (decoder / pre-tokenizer kinds).
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    vocab_type = metadata["vocab_type"].name.lower()
    return tokenizer_info_from_vocab(
        encoded,
        stop_token_ids=stop_token_ids,
        vocab_type=vocab_type,
        vocab_size=size,
        add_prefix_space=bool(metadata["add_prefix_space"]),
    )


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words per row of a token bitmask: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed CPU bitmask, int32 [num_rows, ceil(vocab_size / 32)].

    Bit j of word w of a row allows token 32 * w + j (1 = allowed), xgrammar's layout.
    """
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set disallowed logits to -inf, in place, on the logits' device (plain torch ops).

    logits: float [R, V]. bitmask: int32 [G, ceil(V / 32)] (any device; copied to the logits'
    device). rows: LongTensor [G] of logits rows the bitmask rows apply to (None: G == R, all).
    """
    num_rows, vocab = logits.shape
    if (
        bitmask.dtype != torch.int32
        or bitmask.dim() != 2
        or bitmask.shape[1] < bitmask_width(vocab)
    ):
        raise ValueError(
            f"bitmask must be int32 [G, >= {bitmask_width(vocab)}], got {bitmask.dtype} "
            f"{tuple(bitmask.shape)}"
        )
    bitmask = bitmask.to(logits.device, non_blocking=True)[:, : bitmask_width(vocab)]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    if rows is None:
        if bitmask.shape[0] != num_rows:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {num_rows}; pass rows")
        logits.masked_fill_(allowed == 0, float("-inf"))
    else:
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


class Utf8Guard:
    """Masks the tokens that would complete a UTF-8-encoded surrogate (ED A0..BF ..).

    xgrammar 0.2.x accepts those three bytes as a character in every grammar (JSON strings, '.',
    negated classes), but they are not UTF-8: a detokenizer turns each byte into U+FFFD, so the
    text is not what the grammar checked (three characters where a maxLength counted one). It
    lets no other malformed UTF-8 through. `build` returns None for a vocabulary that cannot
    spell a surrogate, so such grammars pay nothing.
    """

    def __init__(self, starts: list[bool], holds: list[bool], ends: list[int], size: int):
        self.starts = starts  # per token: its bytes start with A0..BF
        self.holds = holds  # per token: its bytes hold ED A0..BF
        self.ends = ends  # per token: 1 ends in the lead byte ED, 0 not, -1 empty (no change)
        self.after_lead = _pack_allowed([not s for s in starts], size)  # int32 [W]
        self.always = _pack_allowed([not h for h in holds], size) if any(holds) else None

    @staticmethod
    def build(tokenizer_info: xgrammar.TokenizerInfo) -> Utf8Guard | None:
        vocab: list[bytes] = tokenizer_info.decoded_vocab
        starts = [bool(b) and 0xA0 <= b[0] <= 0xBF for b in vocab]
        holds = [_SURROGATE.search(b) is not None for b in vocab]
        ends = [(1 if b.endswith(b"\xed") else 0) if b else -1 for b in vocab]
        if not any(holds) and not (any(starts) and 1 in ends):
            return None
        return Utf8Guard(starts, holds, ends, tokenizer_info.vocab_size)

    def allows(self, pending: bool, token_id: int) -> bool:
        if not 0 <= token_id < len(self.ends):
            return True
        return not self.holds[token_id] and not (pending and self.starts[token_id])

    def next_state(self, pending: bool, token_id: int) -> bool:
        end = self.ends[token_id] if 0 <= token_id < len(self.ends) else -1
        return pending if end < 0 else bool(end)

    def restrict(self, bitmask: torch.Tensor, row: int, pending: bool) -> bool:
        """AND the guard into `bitmask[row]`; True if it changed what may be masked."""
        masks = [m for m in (self.always, self.after_lead if pending else None) if m is not None]
        for mask in masks:
            width = min(mask.shape[0], bitmask.shape[1])
            bitmask[row, :width] &= mask[:width]
        return bool(masks)


def _pack_allowed(allowed: list[bool], vocab_size: int) -> torch.Tensor:
    """An int32 bitmask row (xgrammar's layout) with 0 bits where `allowed` is False; ids past
    `allowed` stay allowed."""
    width = bitmask_width(vocab_size)
    bits = torch.ones(width * 32, dtype=torch.int64)
    bits[: len(allowed)] = torch.tensor(allowed, dtype=torch.int64)
    words = (bits.view(width, 32) << torch.arange(32, dtype=torch.int64)).sum(1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class GrammarMatcher:
    """The grammar state of one request (a thin wrapper over `xgrammar.GrammarMatcher`)."""

    def __init__(
        self,
        compiled: xgrammar.CompiledGrammar,
        vocab_size: int,
        utf8_guard: Utf8Guard | None = None,
    ) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.num_accepted = 0
        self._guard = utf8_guard
        # per accepted token (and the start): does the text end in a lone lead byte ED?
        self._pending = [False]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> bool:
        """Write the allowed next tokens into `bitmask[row]` (CPU int32 [*, ceil(V/32)]).

        Returns False when every token is allowed (the row needs no masking). A terminated
        matcher allows nothing but its stop tokens.
        """
        restricted = bool(self._matcher.fill_next_token_bitmask(bitmask, row))
        if self._guard is not None:
            restricted |= self._guard.restrict(bitmask, row, self._pending[-1])
        return restricted

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False (state unchanged) if the grammar rejects it."""
        token_id, pending, guard = int(token_id), self._pending[-1], self._guard
        if guard is not None and not guard.allows(pending, token_id):
            return False
        if not self._matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        self._pending.append(pending if guard is None else guard.next_state(pending, token_id))
        return True

    def accept_string(self, text: str | bytes) -> bool:
        """Advance by raw text (e.g. a forced prefix). Returns False if the grammar rejects it.

        Text is not a token: `rollback` counts accepted tokens only and never undoes it."""
        ok = bool(self._matcher.accept_string(text))
        raw = text.encode() if isinstance(text, str) else text
        if ok and raw:
            self._pending[-1] = raw.endswith(b"\xed")
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (for rejected speculative drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"num_tokens must be in [0, {self.num_accepted}], got {num_tokens}")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            del self._pending[-num_tokens:]

    def is_terminated(self) -> bool:
        """True once a stop token was accepted at the end of a complete match."""
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (a stop token may follow)."""
        return bool(self._matcher.is_completed())

    def fork(self) -> GrammarMatcher:
        """An independent copy of this state (e.g. for drafting ahead)."""
        twin = object.__new__(GrammarMatcher)
        twin._matcher = self._matcher.fork()
        twin.vocab_size = self.vocab_size
        twin.num_accepted = self.num_accepted
        twin._guard = self._guard
        twin._pending = list(self._pending)
        return twin


class GrammarCache:
    """Compiles structured outputs against one tokenizer, cached by (schema_type, schema)."""

    def __init__(self, tokenizer_info: xgrammar.TokenizerInfo, *, max_threads: int = 8) -> None:
        import xgrammar as xgr

        self.tokenizer_info = tokenizer_info
        self.vocab_size: int = tokenizer_info.vocab_size
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads)
        self._utf8_guard = Utf8Guard.build(tokenizer_info)
        self._compiled: dict[tuple[str, str], Any] = {}

    def compile(self, so_args: StructuredOutput | dict) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `so_args` (raises ValueError naming so_args on a bad schema)."""
        so = StructuredOutput.normalise(so_args)
        key = (so.schema_type, so.schema)
        compiled = self._compiled.get(key)
        if compiled is None:
            grammar = parse_grammar(so)
            try:
                compiled = self._compiler.compile_grammar(grammar)
            except RuntimeError as e:
                raise ValueError(f"so_args.schema cannot be compiled: {e}") from e
            self._compiled[key] = compiled
        return compiled

    def matcher(self, so_args: StructuredOutput | dict) -> GrammarMatcher:
        """A fresh matcher (start state) for one request."""
        return GrammarMatcher(self.compile(so_args), self.vocab_size, self._utf8_guard)

    def __len__(self) -> int:
        return len(self._compiled)
