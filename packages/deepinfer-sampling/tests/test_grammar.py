"""Structured outputs: random logits driven through the Sampler always end in accepted strings."""

import json
import re

import jsonschema
import pytest
import torch
from deepinfer_sampling import (
    GrammarCache,
    Sampler,
    SamplingBatch,
    SamplingParams,
    SamplingRow,
    allocate_token_bitmask,
    apply_token_bitmask,
    tokenizer_info_from_tokenizer,
    tokenizer_info_from_vocab,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st


class Vocab:
    """A raw-bytes vocabulary (index = token id) ending in EOS, with its grammar cache."""

    def __init__(self, tokens: list[bytes], padding: int = 0) -> None:
        self.tokens = [*tokens, b"</s>"]
        self.eos = len(self.tokens) - 1
        self.size = len(self.tokens) + padding  # padded logits, like a real model's
        info = tokenizer_info_from_vocab(
            self.tokens, stop_token_ids=[self.eos], vocab_size=self.size
        )
        self.cache = GrammarCache(info)

    def text(self, ids: list[int]) -> str:
        return b"".join(self.tokens[t] for t in ids).decode("utf-8")


# A small byte-level vocabulary: every single byte, a few multi-byte tokens, then EOS.
MULTI = [b'{"', b'":', b'",', b"true", b"false", b"null", b", ", b"  ", b"ab", b"12", b'"}', b"]"]
BYTES = Vocab([bytes([i]) for i in range(256)] + MULTI, padding=5)
VOCAB, EOS, VOCAB_SIZE, CACHE = BYTES.tokens, BYTES.eos, BYTES.size, BYTES.cache
SAMPLER = Sampler()


def generate(so_args, seed, *, temperature=1.0, max_steps=400, vocab=BYTES, bias=None):
    """Sample with random logits (plus `bias`, a [V] tensor) under the grammar until the matcher
    terminates; the text, or None if it did not within max_steps tokens."""
    params = SamplingParams(temperature=temperature, seed=seed, so_args=so_args, max_tokens=None)
    matcher = vocab.cache.matcher(params.so_args)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for step in range(max_steps):
        logits = torch.randn(1, vocab.size, generator=gen) * 2
        if bias is not None:
            logits += bias
        row = SamplingRow(params, position=step, output_token_ids=out, grammar=matcher)
        batch = SamplingBatch.build([row], vocab_size=vocab.size, eos_token_ids=[vocab.eos])
        token = SAMPLER(logits, batch).token_ids.item()
        assert matcher.accept_token(token), f"sampled token {token} rejected by the grammar"
        if matcher.is_terminated():
            assert token == vocab.eos
            return vocab.text(out)
        out.append(token)
    return None


def generate_to_stop(so_args, seed, **kw):
    text = generate(so_args, seed, **kw)
    assert text is not None, f"no termination within {kw.get('max_steps', 400)} steps"
    return text


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
    text = generate_to_stop({"schema_type": "json", "schema": SCHEMA}, seed)
    jsonschema.validate(json.loads(text), SCHEMA)


WIDE = "é日ß😀\u2028"
# JSON outputs: every control character (a JSON string must escape them), the rest of ASCII,
# multi-byte UTF-8 characters, JSON fragments and escapes. Small, so that strings end.
JSON = Vocab(
    [bytes([i]) for i in range(128)]
    + [c.encode() for c in WIDE]
    + [b'{"', b'":', b'",', b"true", b"false", b"null", b", ", b'"}', b"]"]
    + [b"\\n", b'\\"', b"\\\\", b"\\u00", b"-0", b"1e", b".5"]
)
# Added to the random logits (times a drawn weight) so that values tend to close.
CLOSE = torch.zeros(JSON.size)
for closer in [b'"', b"}", b"]", b",", b'"}', b"</s>"]:
    CLOSE[JSON.tokens.index(closer)] = 1.0

NAMES = ["a", "b", "two words", 'q"uote', "é", "back\\slash"]
# Text the JSON vocabulary can spell (enum and const values must be reachable).
TEXT = st.text(st.characters(max_codepoint=127) | st.sampled_from(WIDE), max_size=4)
# Patterns whose literals are JSON-safe (the others are refused: see below).
PATTERNS = [
    r"^[a-z]{0,4}$",
    r"^\d{1,3}(\.\d)?$",
    r"^.{1,3}$",
    r"^[^a]{0,3}$",
    r"^(ab|12)+$",
    r"^\w+\s?\w*$",
    r"^[A-Z][a-z]{0,3}$",
]
FORMATS = ["email", "date", "time", "date-time", "uuid", "ipv4", "hostname"]
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-50, 50)
    | st.floats(-10, 10).map(lambda x: round(x, 2))
    | TEXT,
    lambda inner: (
        st.lists(inner, max_size=2) | st.dictionaries(st.sampled_from(NAMES), inner, max_size=2)
    ),
    max_leaves=3,
)


@st.composite
def string_schemas(draw):
    schema = {"type": "string"}
    kind = draw(st.sampled_from(["plain", "length", "length", "length", "pattern", "format"]))
    if kind == "length":
        lo = draw(st.integers(0, 3))
        bounds = draw(st.sampled_from(["min", "max", "both"]))
        if bounds != "max":
            schema["minLength"] = lo
        if bounds != "min":
            schema["maxLength"] = lo + draw(st.integers(0, 5))
    elif kind == "pattern":
        schema["pattern"] = draw(st.sampled_from(PATTERNS))
    elif kind == "format":
        schema["format"] = draw(st.sampled_from(FORMATS))
    return schema


@st.composite
def number_schemas(draw, kind):
    schema = {"type": kind}
    if kind == "integer" and draw(st.booleans()):
        return schema | {"multipleOf": draw(st.integers(1, 5))}
    values = st.integers(-20, 20) if kind == "integer" else st.floats(-10, 10).map(round)
    lo, hi = draw(st.none() | values), draw(st.none() | values)
    ex_lo, ex_hi = draw(st.booleans()), draw(st.booleans())
    if lo is not None and hi is not None:
        lo, hi = min(lo, hi), max(lo, hi) + 2 * (ex_lo or ex_hi)  # a non-empty range
    if lo is not None:
        schema["exclusiveMinimum" if ex_lo else "minimum"] = lo
    if hi is not None:
        schema["exclusiveMaximum" if ex_hi else "maximum"] = hi
    return schema


TYPED = {
    "string": string_schemas(),
    "integer": number_schemas("integer"),
    "number": number_schemas("number"),
    "boolean": st.just({"type": "boolean"}),
    "null": st.just({"type": "null"}),
}
LEAVES = st.one_of(
    string_schemas(),  # strings twice over: most of xgrammar's slips are in strings
    *TYPED.values(),
    st.sampled_from([{}, True, {"type": ["string", "null"]}, {"type": ["integer", "boolean"]}]),
    st.lists(JSON_VALUES, min_size=1, max_size=3).map(lambda v: {"enum": v}),
    st.lists(TEXT, min_size=1, max_size=3).map(lambda v: {"type": "string", "enum": v}),
    JSON_VALUES.map(lambda v: {"const": v}),
)


@st.composite
def object_schemas(draw, inner):
    props = draw(st.dictionaries(st.sampled_from(NAMES), inner, max_size=3))
    schema = {"type": "object", "properties": props}
    if props:
        schema["required"] = draw(st.lists(st.sampled_from(sorted(props)), unique=True))
    extra = draw(st.sampled_from(["strict", "false", "true", "schema", "names", "pattern"]))
    if extra == "false":
        schema["additionalProperties"] = False
    elif extra in ("true", "schema", "names"):
        schema["additionalProperties"] = True if extra == "true" else draw(inner)
        schema["maxProperties"] = len(props) + draw(st.integers(0, 2))
        if extra == "names":  # declared names satisfy it (a clash is refused: see below)
            names = draw(st.sampled_from([{"maxLength": 2}, {"pattern": "^[a-z]{1,3}$"}]))
            fits = re.compile(names.get("pattern", "^.{0,2}$")).search
            schema["propertyNames"] = names
            schema["properties"] = props = {k: v for k, v in props.items() if fits(k)}
            schema["required"] = [k for k in schema.get("required", []) if k in props]
            schema["maxProperties"] = len(props) + draw(st.integers(0, 2))
    elif extra == "pattern":
        schema["patternProperties"] = {"^x[a-z]?$": draw(inner)}
    return schema


@st.composite
def array_schemas(draw, inner):
    schema = {"type": "array"}
    # xgrammar refuses `true` among prefixItems, maxItems below their count, and minItems
    # above it when no other items are allowed
    prefix = draw(st.lists(inner.filter(lambda s: s is not True), max_size=2))
    schema["items"] = draw(st.just(False) | inner) if prefix else draw(inner)
    if prefix:
        schema["prefixItems"] = prefix
    lo = draw(st.integers(0, len(prefix) if schema["items"] is False else 2))
    if draw(st.booleans()):
        schema["minItems"] = lo
    if draw(st.booleans()):
        schema["maxItems"] = max(lo, len(prefix)) + draw(st.integers(0, 2))
    return schema


@st.composite
def one_of_schemas(draw, inner):
    if draw(st.booleans()):  # options of distinct types
        kinds = st.sampled_from(["string", "integer", "boolean", "null"])
        kinds = draw(st.lists(kinds, min_size=2, max_size=3, unique=True))
        return {"oneOf": [draw(TYPED[kind]) for kind in kinds]}
    tags = draw(st.lists(TEXT, min_size=2, max_size=3, unique=True))
    return {
        "oneOf": [
            {
                "type": "object",
                "properties": {"t": {"const": tag}, "v": draw(inner)},
                "required": ["t"],
            }
            for tag in tags
        ]
    }


def _extend(inner):
    return (
        object_schemas(inner)
        | array_schemas(inner)
        | st.lists(inner, min_size=1, max_size=3).map(lambda s: {"anyOf": s})
        | one_of_schemas(inner)
        | inner.map(lambda s: {"allOf": [s]})
    )


@st.composite
def json_schemas(draw):
    schema = draw(st.recursive(LEAVES, _extend, max_leaves=6))
    if draw(st.integers(0, 4)) == 0:  # the same schema behind a $ref
        wrap = draw(st.sampled_from(["ref", "items"]))
        ref = {"$ref": "#/$defs/node"}
        outer = ref if wrap == "ref" else {"type": "array", "items": ref, "maxItems": 2}
        schema = {"$defs": {"node": schema}, **outer}
    return schema


@settings(max_examples=80, deadline=None)
@given(
    schema=json_schemas(),
    seed=st.integers(0, 2**31),
    scale=st.sampled_from([0.5, 2.0, 4.0]),
    close=st.sampled_from([0.0, 2.0, 4.0]),
)
def test_json_schema_outputs_parse_and_validate(schema, seed, scale, close):
    # Random schemas x random logits x seeds: what the grammar lets finish is JSON that
    # validates (json.loads also rejects raw control characters inside strings).
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(JSON.size, generator=gen) * scale + CLOSE * close
    so = {"schema_type": "json_schema", "schema": schema}
    text = generate(so, seed, vocab=JSON, bias=bias, max_steps=300)
    assume(text is not None)
    jsonschema.validate(json.loads(text), schema)


@settings(max_examples=40, deadline=None)
@given(string=string_schemas(), seed=st.integers(0, 2**31), scale=st.sampled_from([0.5, 2.0]))
def test_string_outputs_parse_and_validate(string, seed, scale):
    # The shape of the report: one string property; strings are where xgrammar slips most.
    schema = {"type": "object", "properties": {"name": string}, "required": ["name"]}
    bias = torch.randn(JSON.size, generator=torch.Generator().manual_seed(seed)) * scale
    text = generate({"schema_type": "json", "schema": schema}, seed, vocab=JSON, bias=bias)
    assume(text is not None)
    jsonschema.validate(json.loads(text), schema)


BOUNDED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}}


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"name": "Ann"}', True),
        ('{"name": "M\x07x"}', False),  # raw control characters: not JSON
        ('{"name": "a\tb"}', False),
        ('{"name": "\x00"}', False),
        ('{"name": "a\\"b\\\\c\\n\\t\\/"}', True),  # escapes, each one character
        ('{"name": "0123456789"}', True),
        ('{"name": "01234567890"}', False),  # 11 characters
        ('{"name": "' + "\\n" * 10 + '"}', True),
        ('{"name": "' + "\\n" * 11 + '"}', False),
        ('{"name": "日本語😀"}', True),
    ],
)
def test_length_bounded_strings_are_json_strings(text, ok):
    matcher = CACHE.matcher({"schema_type": "json_schema", "schema": BOUNDED})
    accepted = matcher.accept_string(text) and matcher.is_completed()
    assert accepted == ok
    if accepted:
        jsonschema.validate(json.loads(text), BOUNDED)


@pytest.mark.parametrize(
    ("char", "ok"), [("a", True), ("\x07", False), ('\\"', True), ("\\u0041", False)]
)
def test_strings_of_length_one_are_json_strings(char, ok):
    # bounds <= 1 compile without a rule of their own (the class is inlined): the same rules.
    # \u escapes are left out of bounded strings: a surrogate pair would count as two.
    one = {"type": "string", "minLength": 1, "maxLength": 1}
    matcher = CACHE.matcher({"schema_type": "json_schema", "schema": one})
    assert (matcher.accept_string(f'"{char}"') and matcher.is_completed()) == ok


# A pull towards the UTF-8 lead byte ED and the bytes A0..BF that after it would encode a
# surrogate (U+D800..U+DFFF: not UTF-8, which xgrammar itself lets through).
SURROGATE_PULL = torch.zeros(VOCAB_SIZE)
SURROGATE_PULL[[0xED, *range(0xA0, 0xC0)]] = 4.0
SURROGATE_PULL[ord('"')] = 2.0
# No '<' where the text could end: xgrammar also matches the EOS token's text "</s>" there.
ANY_CHARS = [
    ("json_schema", {"type": "string", "maxLength": 4}),
    ("json_schema", {"type": "string", "pattern": "^[^<]{1,3}$"}),
    ("json_schema", {"type": "array", "items": {"type": "string"}, "maxItems": 1}),
    ("regex", "[^<]{1,4}"),
    ("ebnf", "root ::= [^<a]{1,4}"),
]


@settings(max_examples=25, deadline=None)
@given(case=st.sampled_from(ANY_CHARS), seed=st.integers(0, 2**31))
def test_outputs_are_utf8_without_surrogates(case, seed):
    kind, schema = case
    bias = SURROGATE_PULL + torch.randn(VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))
    text = generate({"schema_type": kind, "schema": schema}, seed, bias=bias, max_steps=100)
    assume(text is not None)  # generate decodes strictly: a surrogate raises there
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), schema)
    else:  # four characters at most, as the grammar counted them
        assert re.fullmatch("[^<]{1,4}" if kind == "regex" else "[^<a]{1,4}", text), text


def test_utf8_guard_masks_only_surrogate_continuations():
    matcher = CACHE.matcher({"schema_type": "regex", "schema": ".{1,4}"})
    bitmask = allocate_token_bitmask(1, VOCAB_SIZE)

    def allowed():
        matcher.fill_bitmask(bitmask, 0)
        return {t for t in range(VOCAB_SIZE) if bitmask[0, t // 32] >> (t % 32) & 1}

    assert matcher.accept_token(0xED)
    assert allowed() == set(range(0x80, 0xA0))  # ED 80..9F is U+D000..U+D7FF; A0..BF is not
    twin = matcher.fork()
    matcher.rollback(1)
    assert {0xE2, ord("x")} <= allowed()  # back at the start: the guard is off
    assert allowed() & set(range(0xA0, 0xC0)) == set()  # a lone continuation: xgrammar's own
    assert not twin.accept_token(0xA0)  # the fork kept ED: a masked token is rejected too
    assert twin.accept_token(0x9F) and twin.accept_token(0xBF)  # U+D7FF


STRING = {"type": "string"}
REFUSED = [
    ({"type": "number", "multipleOf": 3}, "/", "multipleOf"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "/", "multipleOf"),
    ({"type": "array", "uniqueItems": True}, "/", "uniqueItems"),
    ({"type": "integer", "not": {"const": 4}}, "/", "'not'"),
    ({"if": {"minimum": 0}, "then": {"maximum": 3}}, "/", "'if'"),
    ({"type": "array", "contains": {"const": 3}}, "/", "contains"),
    ({"properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, "/", "dependentRequired"),
    (
        {"properties": {"a": {"type": "string", "maxLength": 3, "pattern": "^a+$"}}},
        "/properties/a",
        "pattern",
    ),
    ({"type": "string", "format": "email", "maxLength": 3}, "/", "format"),
    ({"enum": [1, 5], "maximum": 3}, "/", "'maximum' next to 'enum'"),
    ({"type": "string", "enum": ["a", 1]}, "/", "enum value 1"),
    ({"anyOf": [{"type": "integer"}], "type": "string"}, "/", "next to 'anyOf'"),
    ({"$defs": {"a": STRING}, "$ref": "#/$defs/a", "maxLength": 2}, "/", "next to '$ref'"),
    ({"allOf": [STRING, {"maxLength": 2}]}, "/", "allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "/", "oneOf"),
    ({"type": "object", "properties": {"a": STRING}, "required": ["b"]}, "/", '"b"'),
    ({"type": "object", "additionalProperties": STRING, "required": ["b"]}, "/", '"b"'),
    ({"type": "string", "pattern": '^a"b$'}, "/pattern", "'\"'"),
    ({"items": {"type": "string", "pattern": "^[ -~]+$"}}, "/items/pattern", "range ' '-'~'"),
    ({"type": "string", "pattern": "^[A-z]+$"}, "/pattern", "'\\\\'"),
    ({"type": "string", "pattern": "^a\\\\b$"}, "/pattern", "'\\\\'"),
    ({"type": "string", "pattern": "^a\\nb$"}, "/pattern", "'\\n'"),
    ({"type": "string", "pattern": "^[\\x00-\\x08]$"}, "/pattern", "'\\x00'"),
    ({"type": "string", "pattern": "^(?!a).*$"}, "/pattern", "lookaround"),
    ({"patternProperties": {"^\\t": {}}}, "/patternProperties/^\\t", "'\\t'"),
    ({"properties": {"ab": {}}, "propertyNames": {"maxLength": 1}}, "/", '"ab" fails'),
]


@pytest.mark.parametrize(("schema", "path", "problem"), REFUSED)
def test_schemas_the_grammar_cannot_enforce_are_refused(schema, path, problem):
    # each of these compiles in xgrammar into a grammar that accepts output the schema rejects
    with pytest.raises(ValueError) as info:
        SamplingParams(so_args={"schema_type": "json_schema", "schema": schema})
    message = str(info.value)
    assert message.startswith(f"so_args.schema at {path!r}:") and problem in message, message


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "multipleOf": 4},
        {"type": "string", "pattern": '^[^"\\\\]+\\s\\S\\w\\W\\d\\D.$'},
        {"type": "string", "enum": ["a", "b\nc"], "title": "annotations are fine"},
        {"$defs": {"a": STRING}, "$ref": "#/$defs/a", "description": "x"},
        {"oneOf": [{"type": "string"}, {"type": ["integer", "null"]}]},
        {
            "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
            "$defs": {
                "cat": {"type": "object", "properties": {"t": {"const": "cat"}}, "required": ["t"]},
                "dog": {"type": "object", "properties": {"t": {"const": "dog"}}, "required": ["t"]},
            },
        },
        {"type": "object", "required": ["a"]},
    ],
)
def test_schemas_the_grammar_enforces_are_accepted(schema):
    SamplingParams(so_args={"schema_type": "json_schema", "schema": schema})


REGEXES = [r"[a-c]{1,5}@(x|yz)\.com", r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?", r"(ab|12)+!?"]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), pattern=st.sampled_from(REGEXES))
def test_regex_generation_fullmatches(seed, pattern):
    text = generate_to_stop({"schema_type": "regex", "schema": pattern}, seed)
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
    text = generate_to_stop({"schema_type": "ebnf", "schema": EBNF}, seed, temperature=0.7)
    assert parse_expr(text), text


def test_greedy_under_grammar_and_seeded_reproducible():
    so = {"schema_type": "regex", "schema": r"(ab|12)+"}
    assert generate_to_stop(so, 7) == generate_to_stop(so, 7)
    greedy = generate_to_stop(so, 7, temperature=0.0)
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
