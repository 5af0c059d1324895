"""V4.1 chat encoding: a list of messages -> one prompt string (reference §4).

V4.1 has no Jinja template; DeepSeek builds prompts in Python (`encoding_dsv41.py`). This module
is our own implementation of the same format facts, for text chat:

- The prompt starts with BOS.
- A user (or developer) turn is `<｜User｜>{content}`; a system turn is `<｜System｜>{content}`; a
  latest-reminder turn is `<｜latest_reminder｜>{content}`; an assistant turn is
  `{reasoning}{content}<｜end▁of▁sentence｜>`.
- After a user/developer turn (or a system turn that is not the first message) that is followed
  by an assistant turn, a latest-reminder turn, or nothing, the generation header
  `<｜Assistant｜>` follows, then `<think>` when thinking is on and this is the last user turn,
  else `</think>` (thinking off, or an earlier turn whose reasoning was dropped).
- Thinking mode drops history: assistant turns before the last user turn lose their
  `reasoning_content`, and developer turns before it are removed. Assistant turns after the
  last user turn keep `{reasoning_content}</think>` before their content.
- Reasoning effort is rendered only in thinking mode, once, at the very start:
  `<｜System｜>Reasoning Effort: {N} (range 1-100, the higher the value, the more thorough the
  reasoning)\\n\\n`, sharing the `<｜System｜>` token with a leading system message. V4.1's
  names map low/high/xhigh/max -> 25/50/75/100; the default is "high" (50). vLLM's (OpenAI's)
  low/medium/high are accepted too: "low" and "high" are V4.1's own names, and "medium",
  OpenAI's default level, is V4.1's default "high" (50). An effort given with thinking off is
  an error (it would not be rendered).
- A literal `<｜deepseek_image｜>` typed in message text is escaped to its ASCII-bar spelling
  `<|deepseek_image|>`, so text never produces the image token (this engine is text-only).

Tool definitions, tool calls, tool results, response formats and task tokens are not
implemented here yet; a message that uses them raises NotImplementedError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_model.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    IMAGE_TOKEN,
    LATEST_REMINDER_TOKEN,
    SYSTEM_TOKEN,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
)

REASONING_EFFORT_LEVELS: dict[str, int] = {
    "low": 25,
    "medium": 50,  # vLLM's (OpenAI's) default level: V4.1's default, "high"
    "high": 50,
    "xhigh": 75,
    "max": 100,
}
DEFAULT_REASONING_EFFORT = "high"
REASONING_EFFORT_LINE = (
    "Reasoning Effort: {effort} "
    "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
IMAGE_TOKEN_ESCAPED = "<|deepseek_image|>"

ROLES = ("system", "user", "developer", "assistant", "latest_reminder")
# Fields of the full V4.1 encoding that this text-chat encoder does not render yet.
_UNSUPPORTED_FIELDS = ("tools", "tool_calls", "response_format", "task", "content_blocks")


def resolve_reasoning_effort(reasoning_effort: str | int | None) -> int:
    """The numeric effort 1..100 of `reasoning_effort` (None -> the default "high" = 50)."""
    if reasoning_effort is None:
        reasoning_effort = DEFAULT_REASONING_EFFORT
    if isinstance(reasoning_effort, str):
        if reasoning_effort not in REASONING_EFFORT_LEVELS:
            raise ValueError(
                f"reasoning_effort={reasoning_effort!r} is not allowed: use one of "
                f"{sorted(REASONING_EFFORT_LEVELS, key=REASONING_EFFORT_LEVELS.get)} "
                "or an int in [1, 100]"
            )
        return REASONING_EFFORT_LEVELS[reasoning_effort]
    # bool is an int subclass; True must not silently mean effort 1.
    if type(reasoning_effort) is int and 1 <= reasoning_effort <= 100:
        return reasoning_effort
    raise ValueError(
        f"reasoning_effort={reasoning_effort!r} is not allowed: use an int in [1, 100] or one of "
        f"{sorted(REASONING_EFFORT_LEVELS, key=REASONING_EFFORT_LEVELS.get)}"
    )


def _text(message: Mapping[str, Any], field: str, index: int) -> str:
    """A message's text field: a str, None (empty), or a list of {"type": "text"} blocks."""
    value = message.get(field)
    if value is None:
        return ""
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        parts = []
        for block in value:
            if not isinstance(block, Mapping) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
                raise NotImplementedError(
                    f"messages[{index}].{field}: content block of type {kind!r} is not "
                    "supported (text-only chat encoding; images and tool results are not "
                    "implemented)"
                )
            parts.append(str(block.get("text", "")))
        text = "\n\n".join(parts)
    else:
        raise ValueError(
            f"messages[{index}].{field} must be a str, a list of text blocks or None, "
            f"got {type(value).__name__}"
        )
    return text.replace(IMAGE_TOKEN, IMAGE_TOKEN_ESCAPED)


def _check(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role == "tool":
            raise NotImplementedError(
                f"messages[{i}].role='tool': tool results are not implemented in the V4.1 "
                "chat encoder yet"
            )
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r} is unknown: allowed roles are {ROLES}")
        if message.get("content") is None:
            raise ValueError(
                f"messages[{i}] has no content: every {role} message needs one (a string or a "
                "list of text blocks; '' for an empty turn)"
            )
        for field in _UNSUPPORTED_FIELDS:
            if message.get(field):
                raise NotImplementedError(
                    f"messages[{i}].{field} is not implemented in the V4.1 chat encoder yet"
                )


def _is_user_like(messages: Sequence[Mapping[str, Any]], i: int) -> bool:
    """Turns that open an assistant reply: user, developer, and a system turn after the first."""
    role = messages[i]["role"]
    return role in ("user", "developer") or (role == "system" and i > 0)


def _last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if _is_user_like(messages, i):
            return i
    return -1


def _drop_old_thinking(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Thinking-mode history: no reasoning before the last user turn, no old developer turns."""
    last_user = _last_user_index(messages)
    kept: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message["role"]
        if i >= last_user or role in ("user", "system", "latest_reminder"):
            kept.append(dict(message))
        elif role == "assistant":
            stripped = dict(message)
            stripped.pop("reasoning_content", None)
            kept.append(stripped)
        # a developer turn before the last user turn is dropped
    return kept


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    thinking: bool = False,
    reasoning_effort: str | int | None = None,
) -> str:
    """Encode chat `messages` into the V4.1 prompt string (starts with BOS).

    `messages`: dicts with `role` in system/user/developer/assistant/latest_reminder and
    `content` (str or a list of text blocks); assistant turns may carry `reasoning_content`.
    `thinking`: thinking mode (the reply opens with `<think>`) or chat mode (`</think>`).
    `reasoning_effort`: "low"/"medium"/"high"/"xhigh"/"max" (25/50/50/75/100) or an int 1..100
    (None: "high"), with thinking only. Raises ValueError on an unknown role, a message without
    content, a bad effort, or an effort given with thinking off.
    """
    _check(messages)
    effort = resolve_reasoning_effort(reasoning_effort)
    if not isinstance(thinking, bool):
        raise ValueError(f"thinking must be a bool, got {thinking!r}")
    if reasoning_effort is not None and not thinking:
        raise ValueError(
            f"reasoning_effort={reasoning_effort!r} needs thinking on: V4.1 renders the effort "
            "in thinking mode only; pass thinking=True or leave reasoning_effort unset"
        )
    msgs = _drop_old_thinking(messages) if thinking else [dict(m) for m in messages]
    last_user = _last_user_index(msgs)

    prompt = [BOS_TOKEN]
    for i, message in enumerate(msgs):
        role = message["role"]
        content = _text(message, "content", i)
        if i == 0 and thinking:
            # The effort line sits in the leading system slot, before any first message.
            prompt.append(SYSTEM_TOKEN + REASONING_EFFORT_LINE.format(effort=effort))
            if role == "system":
                prompt.append(content)
        elif role == "system":
            prompt.append(SYSTEM_TOKEN + content)
        if role in ("user", "developer"):
            prompt.append(USER_TOKEN + content)
        elif role == "latest_reminder":
            prompt.append(LATEST_REMINDER_TOKEN + content)
        elif role == "assistant":
            reasoning = ""
            if thinking and i > last_user:
                reasoning = _text(message, "reasoning_content", i) + THINK_END_TOKEN
            prompt.append(reasoning + content + EOS_TOKEN)

        next_role = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if next_role in (None, "assistant", "latest_reminder") and _is_user_like(msgs, i):
            opens_thinking = thinking and i >= last_user
            prompt.append(
                ASSISTANT_TOKEN + (THINK_START_TOKEN if opens_thinking else THINK_END_TOKEN)
            )
    return "".join(prompt)
