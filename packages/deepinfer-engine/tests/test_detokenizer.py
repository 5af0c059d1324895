"""Incremental detokenization and stop strings, against a plain full-decode reference."""

from __future__ import annotations

from deepinfer_engine.detokenizer import IncrementalDetokenizer
from hypothesis import given, settings
from hypothesis import strategies as st


class BytesTokenizer:
    """Token id -> bytes; decode joins the bytes and replaces broken UTF-8 with U+FFFD."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def add(self, piece: bytes) -> int:
        self.pieces.append(piece)
        return len(self.pieces) - 1

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens=True
    ) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


# A token is either whole characters, or one byte of a multi-byte character (so a character can
# be cut across tokens, as byte-level BPE does).
_chars = st.sampled_from([*list("ab c\n."), "é", "中", "😀"])


@st.composite
def tokenized_text(draw):
    tok = BytesTokenizer()
    ids: list[int] = []
    for _ in range(draw(st.integers(1, 25))):
        s = "".join(draw(st.lists(_chars, min_size=1, max_size=3)))
        if len(s) == 1 and len(s.encode()) > 1 and draw(st.booleans()):
            ids += [tok.add(bytes([b])) for b in s.encode()]
        elif len(s) > 1 and len(s[-1].encode()) > 1 and draw(st.booleans()):
            # cut inside the last (multi-byte) character: whole characters and a fragment in
            # one token, as byte-level BPE merges do
            b, last = s.encode(), len(s[-1].encode())
            cut = draw(st.integers(len(b) - last + 1, len(b) - 1))
            ids += [tok.add(b[:cut]), tok.add(b[cut:])]
        else:
            ids.append(tok.add(s.encode()))
    return tok, ids


def reference(tok, ids, stops):
    """Stop at the first token whose full decode (complete characters) contains a stop string."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k]).rstrip("\ufffd")
        # earliest start wins; at equal starts, the first in the user's list
        hits = [(text.find(s), j, s) for j, s in enumerate(stops) if s in text]
        if hits:
            idx, _, s = min(hits)
            return k, text[:idx], s
    return len(ids), tok.decode(ids), None


@settings(max_examples=150, deadline=None)
@given(data=st.data(), case=tokenized_text())
def test_stop_strings_across_token_boundaries(data, case):
    tok, ids = case
    full = tok.decode(ids).replace("\ufffd", "")
    n_stops = data.draw(st.integers(0, 3))
    stops = []
    for _ in range(n_stops):
        if full and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(full) - 1))
            j = data.draw(st.integers(i + 1, min(len(full), i + 4)))
            stops.append(full[i:j])
        else:
            stops.append("".join(data.draw(st.lists(_chars, min_size=1, max_size=3))))
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[], stop=stops)
    k_got, hit = len(ids), None
    for k, t in enumerate(ids, start=1):
        hit = detok.add_token(t)
        if hit is not None:
            k_got = k
            break
    if hit is None:
        detok.flush()
    k_ref, text_ref, stop_ref = reference(tok, ids, stops)
    assert (k_got, detok.text, hit) == (k_ref, text_ref, stop_ref)


def test_multibyte_character_is_held_back_until_complete():
    tok = BytesTokenizer()
    ids = [tok.add(b"x")] + [tok.add(bytes([b])) for b in "中".encode()]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    texts = []
    for t in ids:
        detok.add_token(t)
        texts.append(detok.text)
    assert texts == ["x", "x", "x", "x中"]  # 中 is three bytes


def test_check_stop_false_ignores_stop_strings():
    tok = BytesTokenizer()
    a = tok.add(b"ab")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[], stop=["b"])
    assert detok.add_token(a, check_stop=False) is None
    assert detok.text == "ab"


def test_complete_characters_before_a_cut_character_are_emitted_and_stop_at_once():
    # One token carries "a" plus the first byte of 中: "a" is complete text now, so the stop
    # string "a" fires on this token, not one token later (and not never, if it is the last).
    tok = BytesTokenizer()
    b = "中".encode()
    first, rest = tok.add(b"xa" + b[:1]), tok.add(b[1:])
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    detok.add_token(first)
    assert detok.text == "xa"
    detok.add_token(rest)
    assert detok.text == "xa中"
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[], stop=["a"])
    assert detok.add_token(first) == "a" and detok.text == "x"
