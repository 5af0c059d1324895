"""Structured outputs: random logits driven through the Sampler always end in accepted strings."""

import json
import re

import pytest
import torch
from deepinfer_sampling import (
    GrammarCache,
    Sampler,
    SamplingBatch,
    SamplingParams,
    SamplingRow,
    apply_token_bitmask,
    tokenizer_info_from_tokenizer,
    tokenizer_info_from_vocab,
)
from hypothesis import given, settings
from hypothesis import strategies as st

jsonschema = pytest.importorskip("jsonschema")

# A small byte-level vocabulary: every single byte, a few multi-byte tokens, then EOS.
MULTI = [b'{"', b'":', b'",', b"true", b"false", b"null", b", ", b"  ", b"ab", b"12", b'"}', b"]"]
VOCAB = [bytes([i]) for i in range(256)] + MULTI + [b"</s>"]
EOS = len(VOCAB) - 1
VOCAB_SIZE = len(VOCAB) + 5  # padded logits, like a real model's
INFO = tokenizer_info_from_vocab(VOCAB, stop_token_ids=[EOS], vocab_size=VOCAB_SIZE)
CACHE = GrammarCache(INFO)
SAMPLER = Sampler()


def generate(so_args, seed, *, temperature=1.0, max_steps=400):
    """Sample with random logits under the grammar until the matcher terminates."""
    params = SamplingParams(temperature=temperature, seed=seed, so_args=so_args, max_tokens=None)
    matcher = CACHE.matcher(params.so_args)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for step in range(max_steps):
        logits = torch.randn(1, VOCAB_SIZE, generator=gen) * 2
        row = SamplingRow(params, position=step, output_token_ids=out, grammar=matcher)
        batch = SamplingBatch.build([row], vocab_size=VOCAB_SIZE, eos_token_ids=[EOS])
        token = SAMPLER(logits, batch).token_ids.item()
        assert matcher.accept_token(token), f"sampled token {token} rejected by the grammar"
        if matcher.is_terminated():
            assert token == EOS
            return b"".join(VOCAB[t] for t in out).decode("utf-8")
        out.append(token)
    raise AssertionError(
        f"no termination within {max_steps} steps: {b''.join(VOCAB[t] for t in out)!r}"
    )


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{0,4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3},
        "kind": {"enum": ["a", "b", None]},
    },
    "required": ["name", "age", "ok", "tags", "kind"],
}


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_json_schema_generation_validates(seed):
    text = generate({"schema_type": "json", "schema": SCHEMA}, seed)
    jsonschema.validate(json.loads(text), SCHEMA)


REGEXES = [r"[a-c]{1,5}@(x|yz)\.com", r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?", r"(ab|12)+!?"]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), pattern=st.sampled_from(REGEXES))
def test_regex_generation_fullmatches(seed, pattern):
    text = generate({"schema_type": "regex", "schema": pattern}, seed)
    assert re.fullmatch(pattern, text), text


EBNF = r"""
root ::= expr
expr ::= term (("+" | "*") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""


def parse_expr(text: str) -> bool:
    """Independent recursive-descent recogniser of the EBNF above."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        m = re.match(r"[1-9][0-9]{0,2}", text[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def term() -> bool:
        nonlocal pos
        if text[pos : pos + 1] == "(":
            pos += 1
            if not expr() or text[pos : pos + 1] != ")":
                return False
            pos += 1
            return True
        return num()

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        for _ in range(3):
            if text[pos : pos + 1] in ("+", "*"):
                pos += 1
                if not term():
                    return False
            else:
                break
        return True

    return expr() and pos == len(text)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_ebnf_generation_parses(seed):
    text = generate({"schema_type": "ebnf", "schema": EBNF}, seed, temperature=0.7)
    assert parse_expr(text), text


def test_greedy_under_grammar_and_seeded_reproducible():
    so = {"schema_type": "regex", "schema": r"(ab|12)+"}
    assert generate(so, 7) == generate(so, 7)
    greedy = generate(so, 7, temperature=0.0)
    assert greedy == generate(so, 7, temperature=0.0) and re.fullmatch(r"(ab|12)+", greedy)


def test_bitmask_masks_exactly_disallowed_tokens():
    matcher = CACHE.matcher({"schema_type": "regex", "schema": "[b-d]x"})
    row = SamplingRow(SamplingParams(), 0, grammar=matcher)
    batch = SamplingBatch.build([row, SamplingRow(SamplingParams(), 0)], vocab_size=VOCAB_SIZE)
    x = SAMPLER.processed_logits(torch.zeros(2, VOCAB_SIZE), batch)
    allowed = {i for i in range(VOCAB_SIZE) if x[0, i] == 0}
    assert allowed == {ord("b"), ord("c"), ord("d")}
    assert bool((x[1] == 0).all())  # the unconstrained row is untouched
    # apply_token_bitmask on its own, full batch form.
    logits = torch.zeros(2, VOCAB_SIZE)
    apply_token_bitmask(logits, batch.grammar_bitmask.expand(2, -1).contiguous())
    assert torch.equal(logits[0], logits[1]) and torch.isinf(logits[0]).sum() == VOCAB_SIZE - 3


def test_rollback_fork_and_termination():
    matcher = CACHE.matcher({"schema_type": "regex", "schema": "ab(c|d)"})
    assert matcher.accept_token(VOCAB.index(b"ab"))
    assert matcher.accept_token(ord("c"))
    assert matcher.is_completed() and not matcher.is_terminated()
    twin = matcher.fork()
    matcher.rollback(1)
    assert not matcher.is_completed()
    assert not matcher.accept_token(ord("x"))  # rejected, state unchanged
    assert matcher.accept_token(ord("d")) and matcher.accept_token(EOS)
    assert matcher.is_terminated()
    assert twin.accept_token(EOS) and twin.is_terminated()
    with pytest.raises(ValueError, match="num_tokens"):
        matcher.rollback(5)
    matcher.rollback(3)  # back to the start state
    assert matcher.accept_string("ab")


def test_compile_cache_keyed_by_schema():
    a = CACHE.compile({"schema_type": "json", "schema": {"type": "integer"}})
    b = CACHE.compile({"schema_type": "json_schema", "schema": '{"type": "integer"}'})
    assert a is b
    assert CACHE.compile({"schema_type": "regex", "schema": "[0-9]+"}) is not a


def test_tokenizer_info_from_tokenizers_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["Ġthe"] = len(vocab)
    vocab["<eos>"] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    info = tokenizer_info_from_tokenizer(tok, stop_token_ids=[vocab["<eos>"]], vocab_size=300)
    assert info.vocab_size == 300
    assert info.vocab_type.name == "BYTE_LEVEL"
    assert info.decoded_vocab[vocab["Ġthe"]] == b" the"
    with pytest.raises(ValueError, match="vocab_size"):
        tokenizer_info_from_tokenizer(tok, stop_token_ids=[0], vocab_size=10)


def test_has_allowed_flags_rows_whose_masks_leave_no_token():
    # "a" then the regex allows only its end (EOS); min_tokens=3 masks EOS: a dead end.
    blocked = CACHE.matcher({"schema_type": "regex", "schema": "a"})
    assert blocked.accept_token(ord("a"))
    open_ = CACHE.matcher({"schema_type": "regex", "schema": "ab"})
    assert open_.accept_token(ord("a"))
    rows = [
        SamplingRow(SamplingParams(min_tokens=3), 1, output_token_ids=[ord("a")], grammar=blocked),
        SamplingRow(SamplingParams(), 1, output_token_ids=[ord("a")], grammar=open_),
        SamplingRow(SamplingParams(min_tokens=3), 1, output_token_ids=[ord("a")]),
    ]
    batch = SamplingBatch.build(rows, vocab_size=VOCAB_SIZE, eos_token_ids=[EOS])
    out = SAMPLER(torch.zeros(3, VOCAB_SIZE), batch)
    assert out.has_allowed.tolist() == [False, True, True]
    assert out.token_ids[1].item() == ord("b")
    plain = SamplingBatch.build([rows[2]], vocab_size=VOCAB_SIZE, eos_token_ids=[EOS])
    assert SAMPLER(torch.zeros(1, VOCAB_SIZE), plain).has_allowed is None
