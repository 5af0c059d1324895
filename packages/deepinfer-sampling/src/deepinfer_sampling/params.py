"""SamplingParams: how one request picks its tokens, validated when it is built."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .json_schema import UnsupportedJsonSchema, json_schema_grammar

__all__ = [
    "SCHEMA_TYPES",
    "SamplingParams",
    "StructuredOutput",
    "StructuredOutputsParams",
    "parse_grammar",
]

SchemaType = Literal["json_schema", "regex", "ebnf"]
SCHEMA_TYPES: tuple[str, ...] = ("json_schema", "regex", "ebnf")
_SCHEMA_TYPE_ALIASES = {
    "json": "json_schema",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
}

MAX_SEED = (1 << 63) - 1
MAX_LOGPROBS = 1024
MAX_LOGIT_BIAS = 100.0
MAX_TOKEN_ID = (1 << 31) - 1


@dataclass(frozen=True)
class StructuredOutput:
    """A normalised structured-output request.

    schema_type: "json_schema" | "regex" | "ebnf".
    schema: the schema text. JSON schemas are stored as compact JSON with the user's key order
        (xgrammar emits properties in declared order), so equal schemas share a cache entry.
    """

    schema_type: SchemaType
    schema: str

    @staticmethod
    def normalise(so_args: Any) -> StructuredOutput:
        """Build from `{"schema_type": ..., "schema": ...}` (or a StructuredOutput).

        Accepts "json" for "json_schema", and a dict or a JSON string for JSON schemas.
        Raises ValueError naming `so_args...` on anything else.
        """
        if isinstance(so_args, StructuredOutput):
            return so_args
        if not isinstance(so_args, Mapping):
            raise ValueError(
                f"so_args must be a dict with keys 'schema_type' and 'schema', got "
                f"{type(so_args).__name__}"
            )
        unknown = set(so_args) - {"schema_type", "schema"}
        if unknown:
            raise ValueError(
                f"so_args has unknown keys {sorted(unknown)}; allowed: 'schema_type', 'schema'"
            )
        raw_type = so_args.get("schema_type")
        schema_type = _SCHEMA_TYPE_ALIASES.get(raw_type) if isinstance(raw_type, str) else None
        if schema_type is None:
            raise ValueError(
                f"so_args.schema_type must be one of 'json_schema' (alias 'json'), 'regex', "
                f"'ebnf'; got {raw_type!r}"
            )
        schema = so_args.get("schema")
        if schema_type == "json_schema":
            return StructuredOutput("json_schema", _json_schema_text(schema, "so_args.schema"))
        if not isinstance(schema, str) or not schema:
            raise ValueError(
                f"so_args.schema for {schema_type} must be a non-empty string, got {schema!r}"
            )
        return StructuredOutput(schema_type, schema)  # type: ignore[arg-type]


def _json_schema_text(schema: Any, name: str) -> str:
    """A JSON schema (dict, bool or JSON string) as compact JSON text in the user's key order;
    ValueError naming `name` otherwise."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(schema, (dict, bool)):
        raise ValueError(
            f"{name} for json_schema must be a dict, a bool or a JSON string, "
            f"got {type(schema).__name__}"
        )
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (xgrammar's escapes)."""
    escaped = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = []
    for ch in text:
        if ch in escaped:
            out.append(escaped[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")  # xgrammar's \x reads every hex digit after it
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_SO_KINDS = ("json", "regex", "choice", "grammar")
# vLLM's StructuredOutputsParams fields this engine does not implement, with what they are.
_SO_NOT_IMPLEMENTED = {
    "json_object": "any JSON object",
    "structural_tag": "structural tags",
    "disable_fallback": "backend fallback control",
    "disable_any_whitespace": "JSON without free whitespace",
    "disable_additional_properties": "JSON objects without additional properties",
    "whitespace_pattern": "a custom JSON whitespace pattern",
}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured-output request, `SamplingParams(structured_outputs=...)`: exactly one
    of `json` (a JSON schema: dict, bool or JSON string), `regex`, `choice` (a list of
    non-empty strings: the output is one of them) and `grammar` (EBNF in xgrammar's dialect).

    The other fields of vLLM's class are accepted by name and raise NotImplementedError when
    set (json_object, structural_tag, and the backend and whitespace options).
    """

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        for name, what in _SO_NOT_IMPLEMENTED.items():
            if getattr(self, name):
                raise NotImplementedError(
                    f"structured_outputs.{name} ({what}) is not implemented; use json, regex, "
                    "choice or grammar"
                )
        given = sorted(k for k in _SO_KINDS if getattr(self, k) is not None)
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must give exactly one of {', '.join(_SO_KINDS)}; got "
                f"{', '.join(given) or 'none'}"
            )
        if self.choice is not None:
            choice = self.choice
            if (
                isinstance(choice, str)
                or not isinstance(choice, Sequence)
                or not choice
                or not all(isinstance(c, str) and c for c in choice)
            ):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {choice!r}"
                )
            object.__setattr__(self, "choice", tuple(choice))

    @staticmethod
    def normalise(value: Any) -> StructuredOutputsParams:
        """From a StructuredOutputsParams or a dict of its fields; ValueError naming the
        unknown keys otherwise."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams or a dict with one of "
                f"{', '.join(_SO_KINDS)}, got {type(value).__name__}"
            )
        fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown keys {unknown}; allowed: {', '.join(_SO_KINDS)}"
            )
        return StructuredOutputsParams(**value)

    def structured_output(self) -> StructuredOutput:
        """The same constraint as a StructuredOutput (a choice becomes the EBNF grammar
        ``root ::= "a" | "b" ...``)."""
        if self.json is not None:
            return StructuredOutput(
                "json_schema", _json_schema_text(self.json, "structured_outputs.json")
            )
        if self.choice is not None:
            return StructuredOutput(
                "ebnf", "root ::= " + " | ".join(_ebnf_literal(c) for c in self.choice)
            )
        kind, value = ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        return StructuredOutput("regex" if kind == "regex" else "ebnf", value)


@functools.lru_cache(maxsize=256)
def _parse_grammar_cached(schema_type: str, schema: str) -> Any:
    import xgrammar as xgr  # lazy: xgrammar imports transformers when it loads

    if schema_type == "json_schema":
        return json_schema_grammar(schema)
    if schema_type == "regex":
        return xgr.Grammar.from_regex(schema)
    return xgr.Grammar.from_ebnf(schema)


def parse_grammar(so: StructuredOutput, name: str = "so_args.schema") -> Any:
    """Parse `so` into an `xgrammar.Grammar` (cached by (schema_type, schema)).

    Raises ValueError naming `name` (the field the schema came from) when xgrammar rejects
    it, or (a `json_schema.UnsupportedJsonSchema`) when a JSON schema asks for what the grammar
    would not enforce.
    """
    try:
        return _parse_grammar_cached(so.schema_type, so.schema)
    except UnsupportedJsonSchema:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{name} is not a valid {so.schema_type}: {e}") from e


def _check_number(name: str, value: Any, lo: float, hi: float, *, lo_open=False, hi_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    below = value <= lo if lo_open else value < lo
    above = value >= hi if hi_open else value > hi
    if below or above:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def _check_int(name: str, value: Any, lo: int, hi: int | None = None, *, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an int{none}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        interval = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {interval}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its tokens. Every field is checked on construction.

    n: completions per prompt (>= 1).
    temperature: >= 0; 0 means greedy (argmax after penalties, bias and masks).
    top_p: in (0, 1]; 1 disables. Keeps the smallest prefix of the sorted distribution (after
        min-p and top-k, renormalised) whose mass reaches top_p.
    top_k: -1 or 0 disables, else keeps the k most likely tokens.
    min_p: in [0, 1]; keeps tokens with p >= min_p * p_max (0 disables).
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logits of tokens already
        generated (once, resp. once per occurrence).
    repetition_penalty: in (0, 2]; generated tokens' positive logits are divided by it, negative
        ones multiplied (1 disables).
    max_tokens: >= 1, or None for "up to the context limit" (the engine decides).
    min_tokens: >= 0 and <= max_tokens; EOS and stop_token_ids are masked until reached.
    stop: strings that end the output (the engine matches them on detokenized text).
    stop_token_ids: token ids that end the output, besides EOS.
    ignore_eos: keep generating after EOS (the engine decides; the sampler does not mask EOS).
    logprobs: None (none), or N >= 0: return the sampled token's logprob and the top N (the
        engine also refuses N above the model's vocabulary).
    prompt_logprobs: None (none), or N >= 0: return, for every prompt token after the first,
        its logprob given the tokens before it and the top N there (vLLM's
        `RequestOutput.prompt_logprobs`; the engine refuses N above the vocabulary).
    logit_bias: {token_id: bias}, bias in [-100, 100], added to the logits.
    seq_seed: None (fresh randomness) or an int in [0, 2**63): the sampled token is then a pure
        function of (seq_seed, position, logits). `seed` is an alias; after construction both hold
        the same value.
    so_args: structured output `{"schema_type": "json_schema" | "json" | "regex" | "ebnf",
        "schema": ...}`; normalised to a StructuredOutput and parsed here, so a bad schema fails
        now rather than mid-generation.
    structured_outputs: the same in vLLM's spelling, a `StructuredOutputsParams` or a dict of
        its fields (`{"json": ...}`, `{"regex": ...}`, `{"choice": [...]}`, `{"grammar": ...}`);
        one of `so_args` and `structured_outputs` at a time. `structured_output` is the
        constraint either gives.
    skip_special_tokens: drop the tokens the tokenizer marks special (V4.1: BOS, EOS, PAD)
        from the text (as vLLM, default True). V4.1's role, think, DSML, task and image markers
        are not special in its tokenizer: they stay in the text either way.
    spaces_between_special_tokens: with special tokens in the text (skip_special_tokens
        False), one space separates each from its neighbours (as vLLM's default True); the
        output continues the prompt's text, so a special token first in it is separated from
        the prompt's last token too.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | str | Sequence[str] | None = ()
    stop_token_ids: tuple[int, ...] | Sequence[int] | None = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = field(default=None)
    seq_seed: int | None = None
    seed: int | None = None
    so_args: StructuredOutput | Mapping[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        _check_int("n", self.n, 1)
        _check_number("temperature", self.temperature, 0.0, 1e4)
        _check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        _check_int("max_tokens", self.max_tokens, 1, allow_none=True)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        set_("stop", _normalise_stop(self.stop))
        set_("stop_token_ids", _normalise_token_ids("stop_token_ids", self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, allow_none=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, allow_none=True)
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        set_("logit_bias", _normalise_logit_bias(self.logit_bias))
        _check_int("seq_seed", self.seq_seed, 0, MAX_SEED, allow_none=True)
        _check_int("seed", self.seed, 0, MAX_SEED, allow_none=True)
        if self.seed is not None and self.seq_seed is not None and self.seed != self.seq_seed:
            raise ValueError(
                f"seed is an alias of seq_seed; got different values seed={self.seed} and "
                f"seq_seed={self.seq_seed}"
            )
        merged = self.seq_seed if self.seq_seed is not None else self.seed
        set_("seq_seed", merged)
        set_("seed", merged)
        if self.so_args is not None and self.structured_outputs is not None:
            raise ValueError(
                "so_args and structured_outputs both give a structured output; pass one of them"
            )
        so = None
        if self.so_args is not None:
            so = StructuredOutput.normalise(self.so_args)
            parse_grammar(so)  # raises ValueError("so_args.schema ...") now, not mid-generation
            set_("so_args", so)
        if self.structured_outputs is not None:
            params = StructuredOutputsParams.normalise(self.structured_outputs)
            so = params.structured_output()
            kind = next(k for k in _SO_KINDS if getattr(params, k) is not None)
            parse_grammar(so, f"structured_outputs.{kind}")
            set_("structured_outputs", params)
        object.__setattr__(self, "_structured_output", so)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def structured_output(self) -> StructuredOutput | None:
        """The structured-output constraint of `so_args` or `structured_outputs` (None: none)."""
        return self._structured_output

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied, validated again."""
        return dataclasses.replace(self, **changes)


def _normalise_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stop)


def _normalise_token_ids(name: str, ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints in [0, {MAX_TOKEN_ID}], got {ids!r}")
    for i in ids:
        _check_int(name, i, 0, MAX_TOKEN_ID)
    return tuple(ids)


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict {{token_id: bias}}, got {bias!r}")
    out: dict[int, float] = {}
    for token, value in bias.items():
        # JSON round-trips turn int keys into strings; accept those as in the OpenAI API.
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        _check_int("logit_bias key", token, 0, MAX_TOKEN_ID)
        _check_number(f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        out[token] = float(value)
    return out or None
