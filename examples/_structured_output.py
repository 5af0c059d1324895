"""Structured output: regex, JSON schema and EBNF through `SamplingParams(so_args=...)`.

    uv run examples/_structured_output.py [--model /path/to/DeepSeek-V4.1-Flash]

Every output is guaranteed to match its grammar (the sampler masks disallowed tokens with an
xgrammar bitmask, filled on the CPU while the device runs the forward).
"""

from __future__ import annotations

import argparse
import json

from deepinfer import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "sunny"],
}
EBNF = 'root ::= "The answer is " ("yes" | "no") "."'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(args.model)
    cases = [
        (
            "regex",
            "Give a date:",
            {"schema_type": "regex", "schema": r"20[0-9]{2}-(0[1-9]|1[0-2])"},
        ),
        (
            "json_schema",
            "Weather report as JSON:",
            {"schema_type": "json_schema", "schema": SCHEMA},
        ),
        ("ebnf", "Is the sky blue?", {"schema_type": "ebnf", "schema": EBNF}),
    ]
    params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, so_args=so)
        for i, (_, _, so) in enumerate(cases)
    ]
    outs = llm.generate([prompt for _, prompt, _ in cases], params)
    for (kind, prompt, _), out in zip(cases, outs, strict=True):
        c = out.outputs[0]
        print(f"[{kind}] {prompt!r} -> {c.text!r} (finish_reason={c.finish_reason})")
        if kind == "json_schema" and c.finish_reason == "stop":
            print("    parsed:", json.loads(c.text))


if __name__ == "__main__":
    main()
