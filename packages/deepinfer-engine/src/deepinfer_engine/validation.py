"""Check every request of a `generate` call before any work starts.

A bad request raises `ValueError("prompt {i}: ...")` naming its index and the problem; since
nothing has run yet, nothing is lost. Failures that can only appear mid-run (a grammar with no
allowed token left, non-finite logits) are handled per request by the engine instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from deepinfer_sampling.params import SamplingParams


@dataclass
class ValidatedRequest:
    prompt: str | None  # the text, when the user gave text
    prompt_token_ids: list[int]
    params: SamplingParams


def _as_prompt(i: int, p: Any, encode) -> tuple[str | None, list[int]]:
    if isinstance(p, str):
        if not p:
            raise ValueError(f"prompt {i}: empty prompt")
        return p, list(encode(p))
    if isinstance(p, Mapping):
        if set(p) - {"prompt_token_ids", "prompt"}:
            raise ValueError(
                f"prompt {i}: unknown keys {sorted(set(p) - {'prompt_token_ids', 'prompt'})}; "
                "allowed: 'prompt_token_ids' (or 'prompt')"
            )
        if "prompt_token_ids" in p:
            return p.get("prompt"), _as_ids(i, p["prompt_token_ids"])
        if "prompt" in p:
            return _as_prompt(i, p["prompt"], encode)
        raise ValueError(f"prompt {i}: a dict prompt needs 'prompt_token_ids'")
    if isinstance(p, Sequence) and not isinstance(p, (bytes, bytearray)):
        return None, _as_ids(i, p)
    raise ValueError(
        f"prompt {i}: must be a string, a list of token ids or {{'prompt_token_ids': [...]}}, "
        f"got {type(p).__name__}"
    )


def _is_token_id(t: Any) -> bool:
    # Integral covers numpy/torch-free ints; strings and floats ("1", 1.0) are refused rather
    # than silently converted, bools are not token ids.
    return isinstance(t, Integral) and not isinstance(t, bool)


def _as_ids(i: int, ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt {i}: prompt_token_ids must be a list of ints")
    if not all(_is_token_id(t) for t in ids):
        raise ValueError(f"prompt {i}: prompt_token_ids must be a list of ints")
    return [int(t) for t in ids]


def validate_requests(
    prompts: Any,
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    encode,
    vocab_size: int,
    max_model_len: int,
) -> list[ValidatedRequest]:
    """Normalise and check all requests; raise `ValueError` naming the first bad prompt index.

    prompts: a string, a token-id list, a {"prompt_token_ids": [...]} dict, or a list of these.
    sampling_params: None (defaults), one SamplingParams for all, or one per prompt.
    encode: text -> token ids (the model tokenizer's `encode`).
    """
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence) and prompts and _is_token_id(prompts[0])
    ):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list, got {type(prompts).__name__}")
    if sampling_params is None:
        params_list: list[Any] = [SamplingParams()] * len(prompts)
    elif isinstance(sampling_params, SamplingParams):
        params_list = [sampling_params] * len(prompts)
    elif isinstance(sampling_params, (Mapping, str)) or not isinstance(sampling_params, Iterable):
        raise ValueError(
            "sampling_params must be a SamplingParams or a list of them (one per prompt), got "
            f"{type(sampling_params).__name__}"
        )
    else:
        params_list = list(sampling_params)
        if len(params_list) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts; "
                "pass one SamplingParams or one per prompt"
            )
    out = []
    for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True)):
        if not isinstance(sp, SamplingParams):
            raise ValueError(
                f"prompt {i}: sampling_params must be a deepinfer SamplingParams, "
                f"got {type(sp).__name__}"
            )
        try:
            # Re-check: the dataclass is frozen but a user can bypass that with object.__setattr__.
            sp.replace()
        except ValueError as e:
            raise ValueError(f"prompt {i}: invalid SamplingParams: {e}") from None
        text, ids = _as_prompt(i, p, encode)
        if not ids:
            raise ValueError(f"prompt {i}: empty prompt (no tokens)")
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        if len(ids) >= max_model_len:
            raise ValueError(
                f"prompt {i}: prompt has {len(ids)} tokens, which leaves no room to generate "
                f"under max_model_len={max_model_len} (the limit is {max_model_len - 1})"
            )
        bad_stop = [t for t in sp.stop_token_ids if t >= vocab_size]
        if bad_stop:
            raise ValueError(
                f"prompt {i}: stop_token_ids has {bad_stop[0]}, outside the vocabulary "
                f"[0, {vocab_size})"
            )
        for field in ("logprobs", "prompt_logprobs"):
            n = getattr(sp, field)
            if n is not None and n > vocab_size:
                raise ValueError(
                    f"prompt {i}: {field}={n} asks for more tokens than the model's vocabulary "
                    f"of {vocab_size}"
                )
        bad_bias = [t for t in (sp.logit_bias or {}) if t >= vocab_size]
        if bad_bias:
            raise ValueError(
                f"prompt {i}: logit_bias has token {bad_bias[0]}, outside the vocabulary "
                f"[0, {vocab_size})"
            )
        out.append(ValidatedRequest(text, ids, sp))
    return out
