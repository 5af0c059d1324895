"""`LLM.chat` over the built-in tiny checkpoint: vLLM's `chat_template_kwargs`, thinking and
reasoning effort, and bad conversations named before any work."""

from __future__ import annotations

import pytest
from _tiny_llm import tiny_llm
from deepinfer import SamplingParams
from deepinfer_model.chat import encode_messages

SP = SamplingParams(temperature=0, max_tokens=1)
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(kv_cache_bytes=16 << 20)


def prompt(llm, **kw) -> str:
    return llm.chat(MSG, SP, use_tqdm=False, **kw)[0].prompt


def test_chat_template_kwargs_carry_thinking_and_effort_as_vllm_users_pass_them(llm):
    low = encode_messages(MSG, thinking=True, reasoning_effort="low")
    assert prompt(llm, chat_template_kwargs={"thinking": True, "reasoning_effort": "low"}) == low
    assert prompt(llm, thinking=True, reasoning_effort="low") == low
    # "enable_thinking" is the other spelling vLLM users pass; "medium" is V4.1's default (50)
    on = encode_messages(MSG, thinking=True)
    assert prompt(llm, chat_template_kwargs={"enable_thinking": True}) == on
    medium = {"thinking": True, "reasoning_effort": "medium"}
    assert prompt(llm, chat_template_kwargs=medium) == on
    assert "Reasoning Effort: 50 " in on
    assert prompt(llm) == prompt(llm, chat_template_kwargs={}) == encode_messages(MSG)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"thinking": False, "chat_template_kwargs": {"thinking": True}}, "thinking"),
        (
            {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "max"}},
            "reasoning_effort",
        ),
        ({"chat_template_kwargs": {"thinking": True, "enable_thinking": False}}, "enable_thinking"),
        ({"chat_template_kwargs": {"add_vision_id": True}}, r"unknown keys \['add_vision_id'\]"),
        ({"chat_template_kwargs": ["thinking"]}, "chat_template_kwargs must be a dict"),
        ({"reasoning_effort": "high"}, r"prompt 0: reasoning_effort='high' needs thinking on"),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}}, "needs thinking on"),
    ],
)
def test_conflicting_or_unknown_chat_options_are_errors(llm, kw, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(MSG, SP, use_tqdm=False, **kw)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "messages must not be empty"),
        ([MSG, []], "prompt 1: messages must not be empty"),
        ([{"role": "user"}], r"prompt 0: messages\[0\] has no content"),
        ([MSG, [*MSG, {"role": "assistant", "content": None}]], r"prompt 1: messages\[1\]"),
    ],
)
def test_empty_conversations_and_messages_without_content_are_named(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, SP, use_tqdm=False)
    assert not llm.engine.has_unfinished()
