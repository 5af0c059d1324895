"""JSON-schema grammars whose every complete match is JSON that validates against the schema.

xgrammar 0.2.x turns some schemas into grammars that accept more than the schema allows:

- strings with `minLength` / `maxLength` repeat `[^"\\\\\\r\\n]`: raw control characters (JSON
  forbids U+0000-U+001F in strings, `json.loads` rejects them) and no escapes. That rule is
  replaced by one JSON string character: an unescaped code point >= U+0020 other than `"` and
  `\\`, or a one-character escape (`\\"`, `\\\\`, `\\/`, `\\b`, `\\f`, `\\n`, `\\r`, `\\t`; each
  decodes to exactly one character, so the length bounds still count decoded characters).
- keywords it does not enforce (`multipleOf` on numbers or next to bounds, `uniqueItems`, `not`,
  `if`, `contains`, `dependentRequired`, ...), keywords it drops next to `enum` / `const` /
  `$ref` / `anyOf` / `oneOf` / `allOf`, `required` names missing from `properties`, length bounds
  next to `pattern` / `format`, overlapping `oneOf` options, and patterns that can produce `"`,
  `\\` or a control character (xgrammar writes a pattern's literals into the string unescaped).
  These are refused with an `UnsupportedJsonSchema` (a ValueError) naming the place in the
  schema, rather than compiled into a grammar that could emit output the schema rejects.

Objects are compiled in xgrammar's strict mode (no properties beyond those the schema names) and
with any JSON whitespace between tokens (vLLM's default).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import xgrammar

__all__ = ["UnsupportedJsonSchema", "check_json_schema", "json_schema_grammar"]


class UnsupportedJsonSchema(ValueError):
    """A valid JSON schema that the grammar could not enforce exactly."""


# The class xgrammar 0.2.x prints for one character of a length-bounded string (as a rule of
# its own, or inlined for bounds <= 1), and its replacement: EBNF as xgrammar prints and parses.
_XGRAMMAR_BOUNDED_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r'([^\"\\\0-\x1f] | "\\" [\"\\/bfnrt])'


def json_schema_grammar(schema: str) -> xgrammar.Grammar:
    """The xgrammar Grammar of a JSON schema (JSON text), checked and repaired as above.

    Raises UnsupportedJsonSchema for what the grammar could not enforce, and xgrammar's
    RuntimeError for what xgrammar cannot compile.
    """
    import xgrammar as xgr

    check_json_schema(json.loads(schema))
    grammar = xgr.Grammar.from_json_schema(schema, strict_mode=True, any_whitespace=True)
    text = str(grammar)
    if _XGRAMMAR_BOUNDED_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_XGRAMMAR_BOUNDED_CHAR, _JSON_STRING_CHAR))


# Keywords that constrain a value. Annotations (title, description, default, examples, format:
# validators do not assert it by default) and unknown keywords constrain nothing.
_VALIDATION = frozenset(
    (
        "type",
        "enum",
        "const",
        "multipleOf",
        "maximum",
        "exclusiveMaximum",
        "minimum",
        "exclusiveMinimum",
        "maxLength",
        "minLength",
        "pattern",
        "maxItems",
        "minItems",
        "uniqueItems",
        "maxContains",
        "minContains",
        "contains",
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "maxProperties",
        "minProperties",
        "required",
        "dependentRequired",
        "properties",
        "patternProperties",
        "additionalProperties",
        "unevaluatedProperties",
        "propertyNames",
        "dependentSchemas",
        "dependencies",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
    )
)
_NOT_ENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "$dynamicRef",
    "$recursiveRef",
)
# With one of these in a schema object xgrammar compiles only it and drops the other keywords.
_EXCLUSIVE = ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")
_OBJECT_KEYWORDS = (
    "properties",
    "patternProperties",
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def check_json_schema(schema: Any) -> None:
    """Raise UnsupportedJsonSchema naming the first part of `schema` (a parsed JSON schema) that
    xgrammar's grammar would not enforce; return None if the grammar enforces all of it."""
    _check(schema, "", schema)


def _refuse(path: str, problem: str) -> UnsupportedJsonSchema:
    return UnsupportedJsonSchema(f"so_args.schema at {path or '/'!r}: {problem}")


def _check(node: Any, path: str, root: Any) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, Mapping):
        raise _refuse(path, f"a schema must be an object or a bool, got {json.dumps(node)}")
    keys = set(node)
    for key in _NOT_ENFORCED:
        if key in node:
            raise _refuse(path, f"{key!r} is not supported: the grammar would not enforce it")
    if node.get("uniqueItems") is True:
        raise _refuse(path, "'uniqueItems' is not supported: the grammar would not enforce it")
    _check_exclusive(node, keys, path)
    if "multipleOf" in node:
        _check_multiple_of(node, path)
    _check_strings(node, path)
    _check_required(node, path)
    if "propertyNames" in node:
        _check_property_names(node, path)
    if "allOf" in node and len(node["allOf"]) > 1:
        raise _refuse(path, "'allOf' with more than one schema is not supported; merge them")
    if "oneOf" in node:
        _check_one_of(node["oneOf"], path, root)
    for key in ("enum", "const"):
        if key in node and "type" in node:
            values = node["enum"] if key == "enum" else [node["const"]]
            for value in values:
                if not _has_type(value, node["type"]):
                    raise _refuse(
                        path,
                        f"{key} value {json.dumps(value)} is not of type "
                        f"{json.dumps(node['type'])}; remove it",
                    )
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        for name, sub in (node.get(key) or {}).items():
            _check(sub, f"{path}/{key}/{_escape_pointer(name)}", root)
    for key in ("additionalProperties", "unevaluatedProperties", "propertyNames", "items"):
        if key in node and not isinstance(node[key], list):
            _check(node[key], f"{path}/{key}", root)
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(node.get(key) or ()):
            _check(sub, f"{path}/{key}/{i}", root)


def _check_exclusive(node: Mapping, keys: set[str], path: str) -> None:
    for key in _EXCLUSIVE:
        if key not in node:
            continue
        # enum/const values' type is checked below; the rest stands alone.
        values = key in ("enum", "const")
        dropped = sorted((keys & _VALIDATION) - ({key, "type"} if values else {key}))
        if dropped:
            hint = "keep only values that satisfy them" if values else "move them into it"
            raise _refuse(
                path,
                f"{', '.join(map(repr, dropped))} next to {key!r} would not be enforced "
                f"(xgrammar compiles only {key!r} there); drop them or {hint}",
            )


def _check_multiple_of(node: Mapping, path: str) -> None:
    step = node["multipleOf"]
    # xgrammar enforces multipleOf on plain integers only (it ignores it on numbers and next
    # to bounds).
    if node.get("type") != "integer" or isinstance(step, bool) or not isinstance(step, int):
        raise _refuse(path, "'multipleOf' is supported only as an integer on type 'integer'")
    if step <= 0:
        raise _refuse(path, f"'multipleOf' must be > 0, got {step}")
    bounds = [b for b in _BOUNDS if b in node]
    if bounds:
        raise _refuse(
            path, f"'multipleOf' together with {', '.join(map(repr, bounds))} is not supported"
        )


def _check_strings(node: Mapping, path: str) -> None:
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    for other in ("pattern", "format"):
        if lengths and other in node:
            raise _refuse(
                path,
                f"{' and '.join(map(repr, lengths))} together with {other!r} is not supported "
                f"(xgrammar would ignore the length)",
            )
    if "pattern" in node:
        _check_pattern(node["pattern"], f"{path}/pattern")
    for pattern in node.get("patternProperties") or {}:
        _check_pattern(pattern, f"{path}/patternProperties/{_escape_pointer(pattern)}")


def _check_required(node: Mapping, path: str) -> None:
    required = node.get("required") or []
    # xgrammar checks required names only against `properties`: it drops the others as soon as
    # the object has any keyword of its own (a bare {"required": [...]} is enforced).
    if not required or not any(k in node for k in _OBJECT_KEYWORDS):
        return
    missing = [name for name in required if name not in (node.get("properties") or {})]
    if missing:
        raise _refuse(
            path,
            f"required {', '.join(map(json.dumps, missing))} not in 'properties' would not be "
            f"enforced; add them to 'properties'",
        )


def _check_property_names(node: Mapping, path: str) -> None:
    # xgrammar applies propertyNames to additional properties only: a declared property whose
    # name fails it would still be allowed.
    names = node["propertyNames"]
    if node.get("patternProperties"):
        raise _refuse(path, "'propertyNames' together with 'patternProperties' is not supported")
    for name in node.get("properties") or {}:
        ok = _name_satisfies(name, names)
        if ok is None:
            raise _refuse(
                path,
                "'propertyNames' next to 'properties' is supported only as a bool or with "
                "minLength / maxLength / pattern / enum / const",
            )
        if not ok:
            raise _refuse(
                path, f"property {json.dumps(name)} fails 'propertyNames'; remove one of them"
            )


def _name_satisfies(name: str, schema: Any) -> bool | None:
    """Whether a property name satisfies a propertyNames schema; None if this cannot tell."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, Mapping) or set(schema) & _VALIDATION - {
        "type",
        "minLength",
        "maxLength",
        "pattern",
        "enum",
        "const",
    }:
        return None
    kinds = schema.get("type", "string")
    if "string" not in ([kinds] if isinstance(kinds, str) else kinds):
        return False
    if not schema.get("minLength", 0) <= len(name) <= schema.get("maxLength", len(name)):
        return False
    if "enum" in schema and name not in schema["enum"]:
        return False
    if "const" in schema and name != schema["const"]:
        return False
    if "pattern" in schema:
        try:  # ECMA-262 and Python agree on the common patterns; otherwise, cannot tell
            return re.search(schema["pattern"], name) is not None
        except re.error:
            return None
    return True


def _check_one_of(options: Any, path: str, root: Any) -> None:
    # xgrammar compiles oneOf as anyOf, which is the same only when no value matches two
    # options: accept options of disjoint types, or objects told apart by a const property.
    resolved = [_resolve(option, root) for option in options]
    if len(resolved) < 2 or _disjoint_types(resolved) or _discriminated(resolved):
        return
    raise _refuse(
        path,
        "'oneOf' is compiled as 'anyOf', so a value could match two options; use 'anyOf' where "
        "the options cannot overlap (or give each option a distinct 'type', or a required "
        "property with a distinct 'const')",
    )


def _resolve(node: Any, root: Any, depth: int = 0) -> Any:
    """Follow a local `$ref` ("#/..."); other nodes as they are."""
    ref = node.get("$ref") if isinstance(node, Mapping) else None
    if not isinstance(ref, str) or not ref.startswith("#") or depth > 32:
        return node
    target = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, Mapping) or part not in target:
            return node
        target = target[part]
    return _resolve(target, root, depth + 1)


def _disjoint_types(options: list[Any]) -> bool:
    seen: set[str] = set()
    for option in options:
        kinds = option.get("type") if isinstance(option, Mapping) else None
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds:
            return False
        # integers are numbers: the two overlap
        kinds = {"number" if k == "integer" else k for k in kinds}
        if kinds & seen:
            return False
        seen |= kinds
    return True


def _discriminated(options: list[Any]) -> bool:
    if not all(isinstance(o, Mapping) and o.get("type") == "object" for o in options):
        return False
    common = set.intersection(*(set(o.get("required") or ()) for o in options))
    for name in common:
        consts = []
        for option in options:
            prop = (option.get("properties") or {}).get(name)
            if not isinstance(prop, Mapping) or "const" not in prop:
                break
            consts.append(json.dumps(prop["const"], sort_keys=True))
        else:
            if len(set(consts)) == len(consts):
                return True
    return False


def _has_type(value: Any, kinds: Any) -> bool:
    kinds = [kinds] if isinstance(kinds, str) else kinds
    for kind in kinds:
        if kind == "null" and value is None:
            return True
        if kind == "boolean" and isinstance(value, bool):
            return True
        if kind == "string" and isinstance(value, str):
            return True
        if kind == "array" and isinstance(value, list):
            return True
        if kind == "object" and isinstance(value, Mapping):
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind == "number" or (kind == "integer" and float(value).is_integer()):
            return True
    return False


def _escape_pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


# Characters a JSON string cannot hold raw: xgrammar writes a pattern's literal characters into
# the string as they are (it leaves them out of '.', negated classes and \s \S \w \W \d \D).
def _unsafe(code: int) -> bool:
    return code < 0x20 or code in (0x22, 0x5C)


_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}


def _check_pattern(pattern: Any, path: str) -> None:
    if not isinstance(pattern, str):
        raise _refuse(path, f"a pattern must be a string, got {json.dumps(pattern)}")
    problem = _pattern_problem(pattern)
    if problem:
        raise _refuse(
            path,
            f"pattern {pattern!r} {problem}; xgrammar would write it into the JSON string "
            f"unescaped, which is not JSON. Keep '\"', '\\\\' and control characters out of "
            f"the pattern's literals and character classes ('.', negated classes and \\s \\S "
            f"\\w \\W \\d \\D are fine)",
        )


def _pattern_problem(pattern: str) -> str | None:
    """Why `pattern` (an ECMA-262 regex) can make xgrammar emit a raw '"', '\\' or control
    character, or ignore part of it; None if it cannot."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            char, i = _escaped(pattern, i + 1, in_class=False)
            if char is not None and _unsafe(ord(char)):
                return f"can match {char!r}"
        elif c == "[":
            i, problem = _class_problem(pattern, i + 1)
            if problem:
                return problem
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            return "has a lookaround, which xgrammar does not enforce"
        else:
            if _unsafe(ord(c)):
                return f"can match {c!r}"
            i += 1
    return None


def _class_problem(pattern: str, i: int) -> tuple[int, str | None]:
    """Scan a character class from just after its '['; (index after its ']', problem)."""
    n = len(pattern)
    negated = i < n and pattern[i] == "^"
    i += negated
    problem = None
    while i < n and pattern[i] != "]":
        lo, i = _class_atom(pattern, i)
        hi = lo
        if i + 1 < n and pattern[i] == "-" and pattern[i + 1] != "]":
            hi, i = _class_atom(pattern, i + 1)
            if lo is None or hi is None:  # a class escape next to '-': both are members
                lo = lo if lo is not None else hi
                hi = lo
        if lo is None or negated or problem:
            continue
        a, b = ord(lo), ord(hi)
        bad = next((c for c in (a, 0x22, 0x5C) if a <= c <= b and _unsafe(c)), None)
        if bad is not None:
            what = f"{lo!r}" if lo == hi else f"the range {lo!r}-{hi!r}"
            problem = f"can match {chr(bad)!r} (the class member {what})"
    return i + 1, problem


def _class_atom(pattern: str, i: int) -> tuple[str | None, int]:
    if pattern[i] == "\\":
        return _escaped(pattern, i + 1, in_class=True)
    return pattern[i], i + 1


def _escaped(pattern: str, i: int, *, in_class: bool) -> tuple[str | None, int]:
    """The character an escape denotes (i: just after the backslash), or None for a class
    (\\d \\w ...), an assertion or a back-reference; and the index after the escape."""
    if i >= len(pattern):
        return None, i
    e = pattern[i]
    if e in "dDwWsSB" or (e == "b" and not in_class):
        return None, i + 1
    if e == "b":
        return "\b", i + 1
    if e in _SIMPLE_ESCAPES and not (e == "0" and pattern[i + 1 : i + 2].isdigit()):
        return _SIMPLE_ESCAPES[e], i + 1
    if e == "c" and pattern[i + 1 : i + 2].isalpha():
        return chr(ord(pattern[i + 1]) % 32), i + 2
    if e in "xu":
        digits = 2 if e == "x" else 4
        if e == "u" and pattern[i + 1 : i + 2] == "{":
            end = pattern.find("}", i + 2)
            text, after = (pattern[i + 2 : end], end + 1) if end > 0 else ("", i + 1)
        else:
            text, after = pattern[i + 1 : i + 1 + digits], i + 1 + digits
        try:
            return chr(int(text, 16)), after
        except (ValueError, OverflowError):
            return e, i + 1  # not a code point: ECMA's identity escape
    if e.isdigit() or e in "pPk":
        return None, i + 1  # back-reference or property: xgrammar refuses these itself
    return e, i + 1  # identity escape: \" is '"', \\ is '\'
