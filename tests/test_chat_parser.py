"""Streaming output parser: one character at a time must equal all at once."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.common.chat import ChatOutputParser
from moemesh.common.chat import tokens as tk

D = tk.DSML


def run(text: str, *, thinking: bool, pieces: list[int] | None = None, tools_enabled: bool = True):
    parser = ChatOutputParser(thinking, tools_enabled=tools_enabled, tool_call_id_prefix="call_t_")
    deltas = []
    if pieces is None:
        deltas.append(parser.feed(text))
    else:
        start = 0
        for size in pieces:
            deltas.append(parser.feed(text[start : start + size]))
            start += size
        deltas.append(parser.feed(text[start:]))
    deltas.append(parser.finish())
    return deltas


def collapse(deltas):
    return (
        "".join(d.content for d in deltas),
        "".join(d.reasoning_content for d in deltas),
        [c for d in deltas for c in d.tool_calls],
    )


def per_char(text, thinking, **kw):
    return run(text, thinking=thinking, pieces=[1] * len(text), **kw)


TOOL_OUTPUT = (
    "I will check.\n\n"
    f"<{D}tool_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Zürich "old town"</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
    f'<{D}parameter name="opts" string="false">{{"units": ["C"]}}</{D}parameter>\n'
    f"</{D}invoke>\n"
    f'<{D}invoke name="now">\n\n'
    f"</{D}invoke>\n"
    f"</{D}tool_calls>{tk.EOS}"
)


def test_reasoning_then_content():
    text = f"let me think</think>The answer is 4.{tk.EOS}"
    for deltas in (run(text, thinking=True), per_char(text, True)):
        assert collapse(deltas) == ("The answer is 4.", "let me think", [])


def test_thinking_off_is_all_content_and_eos_is_dropped():
    text = f"Hello <b>world</b> </thin{tk.EOS}ignored"
    for deltas in (run(text, thinking=False), per_char(text, False)):
        assert collapse(deltas) == ("Hello <b>world</b> </thin", "", [])


def test_tool_calls_parsed_into_openai_shape():
    content, reasoning, calls = collapse(run("plan</think>" + TOOL_OUTPUT, thinking=True))
    assert content == "I will check."
    assert reasoning == "plan"
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {"city": 'Zürich "old town"', "days": 3, "opts": {"units": ["C"]}}
    assert json.loads(calls[1].arguments) == {}
    assert [c.id for c in calls] == ["call_t_0", "call_t_1"]
    assert calls[0].to_openai()["function"]["name"] == "get_weather"


def test_char_by_char_equals_all_at_once_with_tools():
    text = "plan</think>" + TOOL_OUTPUT
    assert collapse(per_char(text, True)) == collapse(run(text, thinking=True))


def test_no_delta_ever_contains_part_of_a_marker():
    text = "plan</think>" + TOOL_OUTPUT
    for delta in per_char(text, True):
        for piece in (delta.content, delta.reasoning_content):
            assert "<" + D not in piece and "</think" not in piece and "｜" not in piece


def test_legacy_function_calls_block_is_accepted():
    text = f"\n\n<{D}function_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"a\" string=\"true\">x</{D}parameter>\n</{D}invoke>\n</{D}function_calls>"
    content, _, calls = collapse(per_char(text, False))
    assert content == "" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": "x"}


def test_tools_disabled_leaves_dsml_as_content():
    content, _, calls = collapse(run(TOOL_OUTPUT, thinking=False, tools_enabled=False))
    assert calls == [] and content.startswith("I will check.\n\n<" + D)


def test_unfinished_reasoning_and_unclosed_block_are_released_by_finish():
    assert collapse(per_char("still thinking </thi", True)) == ("", "still thinking </thi", [])
    text = f"x\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}param"
    content, _, calls = collapse(per_char(text, False))
    assert calls == [] and content.startswith("x") and "param" in content


def test_repeated_think_start_is_tolerated():
    assert collapse(per_char("<think>r</think>c", True)) == ("c", "r", [])


def test_trailing_newlines_before_block_are_not_content_but_other_newlines_are():
    assert collapse(per_char("a\n\nb\n", False))[0] == "a\n\nb\n"
    assert collapse(per_char(f"a\n\n\n<{D}tool_calls>\n</{D}tool_calls>", False))[0] == "a\n"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=7), max_size=80), st.booleans())
def test_any_split_equals_all_at_once(pieces, thinking):
    text = ("why</think>" if thinking else "") + TOOL_OUTPUT
    assert collapse(run(text, thinking=thinking, pieces=pieces)) == collapse(run(text, thinking=thinking))
