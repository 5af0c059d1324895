"""Incremental detokenization and stop strings that may be cut across token boundaries.

Decoding every output token alone is wrong for byte-level and sentencepiece vocabularies: one
character can span several tokens (a partial UTF-8 sequence decodes to U+FFFD) and a token's
leading space depends on its left neighbour. So we decode a short window `ids[prefix:]` and
emit only the text beyond `ids[prefix:read]`. While the window ends in an incomplete character
(U+FFFD), the complete characters before it are emitted (UTF-8 decoding of earlier bytes does not
depend on later ones) and only the trailing U+FFFD run is held back: a token carrying "a" plus
the first byte of a character shows "a", and a stop string "a" fires on that token.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens seed the decode window, so the first output token gets its left context.
_PROMPT_CONTEXT = 5


class TokenDecoder(Protocol):
    """decode(ids) with vLLM's two detokenization flags: `skip_special_tokens` drops the tokens
    the tokenizer marks special, and, when they are shown, `spaces_between_special_tokens`
    separates each from its neighbours by a space (the detokenizer passes it only with
    skip_special_tokens=False)."""

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    `text` is the text emitted so far. Stop strings are searched only where a new occurrence can
    be (the new text plus `max_stop_len - 1` characters before it), so the work per token is
    O(window), and an occurrence cut across any number of tokens is still found.
    `skip_special_tokens` and `spaces_between_special_tokens` go to every `decode` (vLLM's
    SamplingParams flags): the text of a window only grows when tokens are appended, spaces
    around special tokens included, so the window rule holds for both.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        ctx = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = ctx
        self._prefix = 0
        self._read = len(ctx)
        self.text = ""
        # Characters of the window beyond ids[prefix:read] already emitted while the window
        # still ended in an incomplete character.
        self._partial = 0
        self.stop = [s for s in (stop or []) if s]
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        if self.skip_special_tokens:  # no special token shown: no spaces to put around one
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=False,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; return the stop string it completed (text is then cut before it).

        With `check_stop=False` (before `min_tokens`) stop strings are not searched.
        """
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text):
            return None  # the window's text has not grown past what was emitted
        new = full_text[len(prefix_text) :]
        old_len = len(self.text)
        if new.endswith(REPLACEMENT_CHAR):
            # Incomplete character: emit the complete ones before it, hold the rest back.
            stable = new.rstrip(REPLACEMENT_CHAR)
            if len(stable) <= self._partial:
                return None
            self.text += stable[self._partial :]
            self._partial = len(stable)
        else:
            self.text += new[self._partial :]
            self._prefix, self._read = self._read, len(self._ids)
            self._partial = 0
        if check_stop and self.stop:
            return self._cut_at_stop(old_len)
        return None

    def _cut_at_stop(self, old_len: int) -> str | None:
        """Find the earliest stop string occurrence that ends in the new text and cut there."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def flush(self) -> None:
        """At the end of a sequence, emit text held back waiting for a character to complete."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text):
            self.text += full_text[len(prefix_text) :][self._partial :]
        self._prefix = self._read = len(self._ids)
        self._partial = 0
