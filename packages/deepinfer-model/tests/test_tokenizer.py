"""Tokenizer wrapper over a byte-level tokenizer.json with the V4.1 special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepinfer_model.chat import encode_messages
from deepinfer_model.tiny_checkpoint import (
    TINY_SPECIAL_TOKENS,
    build_tiny_tokenizer,
    byte_level_alphabet,
    tiny_tokenizer_config,
)
from deepinfer_model.tokenizer import V41_SPECIAL_TOKENS, Tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

N_SPECIAL = len(TINY_SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text(build_tiny_tokenizer().to_str())
    (d / "tokenizer_config.json").write_text(json.dumps(tiny_tokenizer_config()))
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_ids_and_sizes(tok: Tokenizer) -> None:
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.vocab_size == N_SPECIAL + 256
    assert set(V41_SPECIAL_TOKENS) <= set(TINY_SPECIAL_TOKENS)
    for i, t in enumerate(TINY_SPECIAL_TOKENS):
        assert tok.id_to_token(i) == t and tok.token_to_id(t) == i


def test_alphabet_is_a_bijection_onto_printable_chars() -> None:
    alpha = byte_level_alphabet()
    assert len(set(alpha.values())) == 256
    assert all(ch.isprintable() and not ch.isspace() for ch in alpha.values())
    assert alpha[ord("A")] == "A" and alpha[ord(" ")] == "Ġ" and alpha[ord("\n")] == "Ċ"


def test_encode_is_bytes_without_bos(tok: Tokenizer) -> None:
    text = "héllo\n"
    assert tok.encode(text) == [N_SPECIAL + b for b in text.encode("utf-8")]


def test_special_tokens_in_text_map_to_their_ids(tok: Tokenizer) -> None:
    prompt = encode_messages([{"role": "user", "content": "hi"}])
    ids = tok.encode(prompt)
    expected = [
        tok.token_to_id("<｜begin▁of▁sentence｜>"),
        tok.token_to_id("<｜User｜>"),
        N_SPECIAL + ord("h"),
        N_SPECIAL + ord("i"),
        tok.token_to_id("<｜Assistant｜>"),
        tok.token_to_id("</think>"),
    ]
    assert ids == expected


def test_decode_skips_sentence_tokens_but_keeps_markers(tok: Tokenizer) -> None:
    ids = [0, *tok.encode("a<think>b"), 1]
    assert tok.decode(ids) == "a<think>b"
    assert (
        tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
        == "<｜begin▁of▁sentence｜>a<think>b<｜end▁of▁sentence｜>"
    )
    # vLLM's default: a special token shown in the text stands apart (markers are not special)
    assert (
        tok.decode(ids, skip_special_tokens=False)
        == "<｜begin▁of▁sentence｜> a<think>b <｜end▁of▁sentence｜>"
    )
    assert tok.decode([0, 1], skip_special_tokens=False) == (
        "<｜begin▁of▁sentence｜> <｜end▁of▁sentence｜>"
    )
    assert tok.special_ids == {0, 1, 2}


def test_image_token_stays_in_decoded_text_as_in_the_released_tokenizer(tok: Tokenizer) -> None:
    # DeepSeek's tokenizer.json does not mark <｜deepseek_image｜> special, so decoding keeps it
    image = tok.token_to_id("<｜deepseek_image｜>")
    assert tok.decode([image, *tok.encode("a")]) == "<｜deepseek_image｜>a"
    specials = {t.content for t in tok.backend.get_added_tokens_decoder().values() if t.special}
    assert specials == {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"}


def test_the_builtin_checkpoints_tokenizer_keeps_the_image_token_too() -> None:
    from deepinfer_model.builtin import builtin_checkpoint

    tok = Tokenizer.from_dir(builtin_checkpoint())
    image = tok.token_to_id("<｜deepseek_image｜>")
    assert tok.decode([image]) == "<｜deepseek_image｜>"
    assert tok.special_ids == {tok.bos_token_id, tok.eos_token_id, tok.token_to_id("<｜▁pad▁｜>")}


def test_bad_ids_and_inputs(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_token(-1)
    with pytest.raises(ValueError, match="text must be a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not in the tokenizer vocabulary"):
        tok.token_to_id("<｜nope｜>")


def test_missing_files_and_bad_config(tmp_path: Path, tok_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<x>"}}))
    with pytest.raises(ValueError, match="eos_token '<x>'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": 3}))
    with pytest.raises(ValueError, match="'bos_token'"):
        Tokenizer.from_dir(tmp_path)
    # Without tokenizer_config.json the V4.1 sentence tokens are the defaults.
    (tmp_path / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(tmp_path).eos_token_id == 1


@given(st.text(max_size=40))
@settings(max_examples=60, deadline=None)
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    # Text that spells a special token comes back as the token, so only plain text round trips
    # byte-exactly; strip the '<' that starts every special token.
    text = text.replace("<", "(").replace("｜DSML｜", "DSML")
    ids = tok.encode(text)
    assert ids == [N_SPECIAL + b for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
