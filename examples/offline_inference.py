"""Offline batch generation with deepinfer.

    uv run examples/offline_inference.py          # the built-in tiny checkpoint (CPU is fine)
    uv run examples/offline_inference.py --model /path/to/DeepSeek-V4.1-Flash --max-tokens 128

With no --model, DEEPINFER_HF_MODEL_DIR is used when set, else the built-in tiny checkpoint: a 25M
parameter model of V4.1's architecture trained briefly on Shakespeare, Milton and Python's
standard library, so expect English-looking verse and code-like text, not answers.
"""

from __future__ import annotations

import argparse
import logging

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir or hub id (default: see above)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0, help="per-request seed (reproducible output)")
    ap.add_argument("--accelerator", default=None, choices=["nvidia", "ascend", "cpu"])
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("prompts", nargs="*", help="prompts (default: four built-in ones)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    try:
        llm = LLM(args.model, accelerator=args.accelerator, dtype=args.dtype)
    except (ValueError, NotImplementedError) as e:
        # a value this machine or model cannot take; the message names the argument
        ap.error(str(e))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    outputs = llm.generate(args.prompts or PROMPTS, params)
    print("-" * 60)
    for out in outputs:
        c = out.outputs[0]
        print(f"Prompt:    {out.prompt!r}")
        print(
            f"Generated: {c.text!r}  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})"
        )
        print("-" * 60)


if __name__ == "__main__":
    main()
