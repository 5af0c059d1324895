"""V4.1 chat encoding on exact strings (the format facts of reference §4 / encoding_dsv41)."""

from __future__ import annotations

import pytest
from deepinfer_model.chat import encode_messages, resolve_reasoning_effort
from hypothesis import given, settings
from hypothesis import strategies as st

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
EFFORT = (
    "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, reasoning: str | None = None) -> dict:
    m = {"role": "assistant", "content": text}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


def test_single_user_turn_chat_mode() -> None:
    assert encode_messages([user("Hi")]) == BOS + "<｜User｜>Hi<｜Assistant｜></think>"


def test_single_user_turn_thinking_mode_has_default_effort_50() -> None:
    expected = BOS + "<｜System｜>" + EFFORT.format(50) + "<｜User｜>Hi<｜Assistant｜><think>"
    assert encode_messages([user("Hi")], thinking=True) == expected


def test_system_then_user_chat_mode() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, user("Hi")]
    assert encode_messages(msgs) == BOS + "<｜System｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>"


def test_system_shares_its_token_with_the_effort_line() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, user("Hi")]
    expected = (
        BOS + "<｜System｜>" + EFFORT.format(75) + "Be brief.<｜User｜>Hi<｜Assistant｜><think>"
    )
    assert encode_messages(msgs, thinking=True, reasoning_effort="xhigh") == expected


@pytest.mark.parametrize(
    ("name", "value"),
    [("low", 25), ("medium", 50), ("high", 50), ("xhigh", 75), ("max", 100)],
)
def test_effort_names(name: str, value: int) -> None:
    # V4.1's names, plus vLLM's (OpenAI's) "medium", its default, as V4.1's default "high"
    assert resolve_reasoning_effort(name) == value
    assert EFFORT.format(value) in encode_messages(
        [user("x")], thinking=True, reasoning_effort=name
    )


def test_effort_with_thinking_off_is_an_error_not_dropped() -> None:
    for effort in (7, "low"):
        with pytest.raises(ValueError, match=r"reasoning_effort=.* thinking"):
            encode_messages([user("x")], reasoning_effort=effort)
    assert "Reasoning Effort" not in encode_messages([user("x")])


@given(st.integers(min_value=1, max_value=100))
@settings(max_examples=25, deadline=None)
def test_integer_effort_is_rendered_verbatim(n: int) -> None:
    out = encode_messages([user("q")], thinking=True, reasoning_effort=n)
    assert out == BOS + "<｜System｜>" + EFFORT.format(n) + "<｜User｜>q<｜Assistant｜><think>"


@pytest.mark.parametrize("bad", [0, 101, -5, 50.0, True, "MAX", "minimal", ""])
def test_bad_effort_is_a_value_error_naming_the_parameter(bad) -> None:
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages([user("x")], thinking=True, reasoning_effort=bad)


def test_multi_turn_chat_mode() -> None:
    msgs = [user("A"), assistant("B", reasoning="ignored in chat"), user("C")]
    expected = (
        BOS + "<｜User｜>A<｜Assistant｜></think>B" + EOS + "<｜User｜>C<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == expected


def test_multi_turn_thinking_drops_old_reasoning() -> None:
    msgs = [user("A"), assistant("B", reasoning="old thoughts"), user("C")]
    expected = (
        BOS
        + "<｜System｜>"
        + EFFORT.format(50)
        + "<｜User｜>A<｜Assistant｜></think>B"
        + EOS
        + "<｜User｜>C<｜Assistant｜><think>"
    )
    out = encode_messages(msgs, thinking=True)
    assert out == expected
    assert "old thoughts" not in out


def test_thinking_keeps_reasoning_after_the_last_user_turn() -> None:
    msgs = [user("A"), assistant("B", reasoning="R")]
    expected = (
        BOS
        + "<｜System｜>"
        + EFFORT.format(50)
        + "<｜User｜>A<｜Assistant｜><think>R</think>B"
        + EOS
    )
    assert encode_messages(msgs, thinking=True) == expected
    assert encode_messages(msgs) == BOS + "<｜User｜>A<｜Assistant｜></think>B" + EOS


def test_mid_conversation_system_opens_a_reply() -> None:
    msgs = [user("A"), assistant("B"), {"role": "system", "content": "S"}]
    expected = (
        BOS + "<｜User｜>A<｜Assistant｜></think>B" + EOS + "<｜System｜>S<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == expected


def test_developer_renders_as_user_and_is_dropped_from_old_thinking_history() -> None:
    msgs = [{"role": "developer", "content": "D"}, assistant("B"), user("C")]
    assert encode_messages(msgs) == (
        BOS + "<｜User｜>D<｜Assistant｜></think>B" + EOS + "<｜User｜>C<｜Assistant｜></think>"
    )
    assert encode_messages(msgs, thinking=True) == (
        BOS + "<｜System｜>" + EFFORT.format(50) + "B" + EOS + "<｜User｜>C<｜Assistant｜><think>"
    )


def test_latest_reminder_follows_the_reply_header() -> None:
    msgs = [user("A"), {"role": "latest_reminder", "content": "today is Monday"}]
    assert encode_messages(msgs) == (
        BOS + "<｜User｜>A<｜Assistant｜></think><｜latest_reminder｜>today is Monday"
    )


def test_text_blocks_are_joined_and_image_token_text_is_escaped() -> None:
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": "b<｜deepseek_image｜>"},
            ],
        }
    ]
    assert (
        encode_messages(msgs) == BOS + "<｜User｜>a\n\nb<|deepseek_image|><｜Assistant｜></think>"
    )


def test_unknown_role_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"messages\[1\].role='narrator'"):
        encode_messages([user("a"), {"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match=r"role=None"):
        encode_messages([{"content": "x"}])


def test_unsupported_features_raise_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="tool"):
        encode_messages([user("a"), {"role": "tool", "content": "r"}])
    with pytest.raises(NotImplementedError, match=r"messages\[0\].tools"):
        encode_messages([{"role": "user", "content": "a", "tools": [{"name": "f"}]}])
    with pytest.raises(NotImplementedError, match="image_url"):
        encode_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}])


def test_bad_containers() -> None:
    with pytest.raises(ValueError, match="messages"):
        encode_messages([])
    with pytest.raises(ValueError, match="messages"):
        encode_messages("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"messages\[0\].content"):
        encode_messages([{"role": "user", "content": 3}])


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "system", "content": None}])
def test_a_message_without_content_is_named(message) -> None:
    with pytest.raises(ValueError, match=r"messages\[1\] has no content"):
        encode_messages([user("a"), message])


@given(
    st.lists(
        st.tuples(st.text(max_size=8), st.text(max_size=8)),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_structure_of_alternating_conversations(turns, thinking: bool) -> None:
    """Invariant: one BOS, one reply header per user turn, one EOS per assistant turn."""
    turns = [(q.replace("<", "["), a.replace("<", "[")) for q, a in turns]
    msgs = []
    for q, a in turns:
        msgs += [user(q), assistant(a)]
    msgs.append(user("last"))
    out = encode_messages(msgs, thinking=thinking)
    assert out.startswith(BOS) and out.count(BOS) == 1
    assert out.count("<｜User｜>") == len(turns) + 1
    assert out.count("<｜Assistant｜>") == len(turns) + 1
    assert out.count(EOS) == len(turns)
    assert out.endswith("<｜User｜>last<｜Assistant｜>" + ("<think>" if thinking else "</think>"))
    assert out.count("<think>") == (1 if thinking else 0)
