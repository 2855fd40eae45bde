"""DeepSeek-V4 chat encoding: golden strings derived by hand from the published rules."""

import json

import pytest

from moemesh.common.chat import SPECIAL_TOKENS, ChatEncodingError, encode_messages
from moemesh.common.chat import tokens as tk
from moemesh.common.chat.dsml import render_tools_section

B, E, U, A = tk.BOS, tk.EOS, tk.USER, tk.ASSISTANT

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}


def test_single_turn_thinking_off_and_on():
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_messages(messages) == f"{B}{U}Hi{A}</think>"
    assert encode_messages(messages, thinking=True) == f"{B}{U}Hi{A}<think>"
    assert encode_messages(messages, add_bos=False) == f"{U}Hi{A}</think>"


def test_system_prompt_is_bare_text_after_bos():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert encode_messages(messages) == f"{B}Be brief.{U}Hi{A}</think>"


def test_multi_turn_thinking_drops_earlier_reasoning():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    expected = f"{B}S{U}q1{A}</think>a1{E}{U}q2{A}<think>"
    assert encode_messages(messages, thinking=True) == expected
    assert "r1" not in encode_messages(messages, thinking=True)
    assert encode_messages(messages, thinking=False) == f"{B}S{U}q1{A}</think>a1{E}{U}q2{A}</think>"


def test_multi_turn_thinking_keeps_reasoning_when_not_dropping():
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    expected = f"{B}{U}q1{A}<think>r1</think>a1{E}{U}q2{A}<think>"
    assert encode_messages(messages, thinking=True, drop_earlier_reasoning=False) == expected


def test_content_parts_are_joined():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert encode_messages(messages) == f"{B}{U}ab{A}</think>"


def test_tools_go_into_an_inserted_system_part():
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = encode_messages(messages, tools=[WEATHER_TOOL])
    section = render_tools_section([WEATHER_TOOL["function"]])
    assert prompt == f"{B}\n\n{section}{U}Weather in Paris?{A}</think>"
    assert json.dumps(WEATHER_TOOL["function"], ensure_ascii=False) in section
    assert section.startswith("## Tools\n")


def test_tools_appended_to_existing_system_prompt():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    prompt = encode_messages(messages, tools=[WEATHER_TOOL])
    assert prompt.startswith(f"{B}S\n\n## Tools\n")
    assert prompt.endswith(f"{U}q{A}</think>")


def test_tool_call_round_trip_with_results_in_call_order():
    call = lambda cid, city: {  # noqa: E731
        "id": cid,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "days": 2})},
    }
    messages = [
        {"role": "user", "content": "Paris and Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "need tools", "tool_calls": [call("c1", "Paris"), call("c2", "Rome")]},
        {"role": "tool", "tool_call_id": "c2", "content": "rainy"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    prompt = encode_messages(messages, tools=[WEATHER_TOOL], thinking=True)
    d = tk.DSML
    block = (
        f"<{d}tool_calls>\n"
        f'<{d}invoke name="get_weather">\n'
        f'<{d}parameter name="city" string="true">Paris</{d}parameter>\n'
        f'<{d}parameter name="days" string="false">2</{d}parameter>\n'
        f"</{d}invoke>\n"
        f'<{d}invoke name="get_weather">\n'
        f'<{d}parameter name="city" string="true">Rome</{d}parameter>\n'
        f'<{d}parameter name="days" string="false">2</{d}parameter>\n'
        f"</{d}invoke>\n"
        f"</{d}tool_calls>"
    )
    tail = (
        f"{U}Paris and Rome?{A}<think>need tools</think>\n\n{block}{E}"
        f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>rainy</tool_result>{A}<think>"
    )
    assert prompt.endswith(tail)


def test_user_text_after_tool_results_joins_the_same_turn():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "x", "content": "42"},
        {"role": "user", "content": "thanks"},
    ]
    prompt = encode_messages(messages)
    assert prompt.endswith(f"{U}<tool_result>42</tool_result>\n\nthanks{A}</think>")


def test_max_reasoning_effort_prefix_only_when_thinking():
    messages = [{"role": "user", "content": "q"}]
    assert encode_messages(messages, thinking=True, reasoning_effort="max").startswith(f"{B}Reasoning Effort: Absolute")
    assert encode_messages(messages, thinking=False, reasoning_effort="max") == f"{B}{U}q{A}</think>"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "developer", "content": ""}],
        [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}],
    ],
)
def test_invalid_messages_raise(messages):
    with pytest.raises(ChatEncodingError):
        encode_messages(messages)


def test_special_tokens_cover_what_the_encoder_writes():
    for token in (tk.BOS, tk.EOS, tk.USER, tk.ASSISTANT, tk.THINK_START, tk.THINK_END, tk.DSML):
        assert token in SPECIAL_TOKENS
    assert len(set(SPECIAL_TOKENS)) == len(SPECIAL_TOKENS)
