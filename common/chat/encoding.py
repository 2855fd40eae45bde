"""DeepSeek-V4 chat encoding: OpenAI-style messages -> the prompt string the model expects.

Written from the rules of DeepSeek's published `encoding/encoding_dsv4.py`:

- The prompt is `BOS` followed by each message in turn. A system message is its bare
  content (tool definitions appended after a blank line). A user message is
  `<｜User｜>` + content. An assistant message is `[reasoning</think>]content[tool calls]EOS`.
- There is no tool role: tool results become `<tool_result>...</tool_result>` blocks of a
  user turn (consecutive user/tool messages merge into one turn, parts joined by a blank
  line), ordered like the calls of the preceding assistant message.
- After a user turn that the assistant answers (the next message, or the reply we are
  about to generate) comes `<｜Assistant｜>` and then `<think>` when the model should reason
  here, or `</think>` when it should answer directly. So thinking on ends the prompt with
  `<｜Assistant｜><think>` and thinking off with `<｜Assistant｜></think>`.
- Multi-turn with thinking on: reasoning of turns before the last user turn is dropped
  (those turns render as `<｜Assistant｜></think>content EOS`), unless any message carries
  tools, in which case every turn keeps its reasoning (tool-use chains depend on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moemesh.common.chat import dsml
from moemesh.common.chat import tokens as tk

REASONING_EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatEncodingError(ValueError):
    """Messages that cannot be encoded (unknown role, wrong content type, ...)."""


@dataclass
class _Turn:
    """One rendered unit after tool messages were merged into user turns."""

    role: str  # system | developer | user | assistant
    text: str = ""
    functions: list[dict] | None = None  # tool schemas (system/developer only)
    reasoning: str | None = None  # assistant only
    tool_calls: list[tuple[str, Any, str | None]] = field(default_factory=list)  # (name, arguments, id)
    # user only: ("text", text, None) or ("tool_result", text, tool_call_id)
    parts: list[tuple[str, str, str | None]] = field(default_factory=list)


def content_text(content: Any, *, where: str) -> str:
    """A message's content as text: a string, None, or a list of `{"type": "text"}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatEncodingError(f"{where}: unsupported content part {kind!r} (only text)")
        return "".join(texts)
    raise ChatEncodingError(f"{where}: content must be a string, a list of text parts or null")


def _tool_call_fields(call: Any, where: str) -> tuple[str, Any, str | None]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatEncodingError(f"{where}: a tool call needs function.name")
    return function["name"], function.get("arguments", "{}"), call.get("id")


def _merge_turns(messages: list[dict]) -> list[_Turn]:
    turns: list[_Turn] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ChatEncodingError(f"{where}: a message must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise ChatEncodingError(f"{where}: unknown role {role!r}")
        text = content_text(message.get("content"), where=where)
        if role in ("user", "tool"):
            part = ("text", text, None) if role == "user" else ("tool_result", text, message.get("tool_call_id"))
            if turns and turns[-1].role == "user":
                turns[-1].parts.append(part)
            else:
                turns.append(_Turn(role="user", parts=[part]))
        elif role == "assistant":
            calls = [_tool_call_fields(call, where) for call in message.get("tool_calls") or []]
            reasoning = message.get("reasoning_content")
            turns.append(_Turn(role="assistant", text=text, reasoning=reasoning, tool_calls=calls))
        else:
            if role == "developer" and not text:
                raise ChatEncodingError(f"{where}: a developer message needs content")
            turns.append(_Turn(role=role, text=text))
    return turns


def _order_tool_results(turns: list[_Turn]) -> None:
    """Tool results follow the order of the calls of the latest assistant message."""
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            call_order = {call_id: i for i, (_, _, call_id) in enumerate(turn.tool_calls) if call_id}
        elif turn.role == "user" and call_order:
            results = [part for part in turn.parts if part[0] == "tool_result"]
            if len(results) < 2:
                continue
            ordered = iter(sorted(results, key=lambda part: call_order.get(part[2] or "", 0)))
            turn.parts = [next(ordered) if part[0] == "tool_result" else part for part in turn.parts]


def _last_user_index(turns: list[_Turn]) -> int | None:
    for index in range(len(turns) - 1, -1, -1):
        if turns[index].role in ("user", "developer"):
            return index
    return None


def _drop_earlier_reasoning(turns: list[_Turn]) -> list[_Turn]:
    """Before the last user turn: assistant reasoning is removed, developer turns vanish."""
    last_user = _last_user_index(turns)
    if last_user is None:
        return turns
    kept = []
    for index, turn in enumerate(turns):
        if index >= last_user or turn.role in ("user", "system"):
            kept.append(turn)
        elif turn.role == "assistant":
            turn.reasoning = None
            kept.append(turn)
    return kept


def _render_user(turn: _Turn) -> str:
    pieces = [
        text if kind == "text" else f"{tk.TOOL_RESULT_OPEN}{text}{tk.TOOL_RESULT_CLOSE}"
        for kind, text, _ in turn.parts
    ]
    return tk.USER + "\n\n".join(pieces)


def _render_turn(turn: _Turn, *, reasoning_visible: bool) -> str:
    if turn.role == "system":
        text = turn.text
        if turn.functions:
            text += "\n\n" + dsml.render_tools_section(turn.functions)
        return text
    if turn.role == "developer":
        text = tk.USER + turn.text
        if turn.functions:
            text += "\n\n" + dsml.render_tools_section(turn.functions)
        return text
    if turn.role == "user":
        return _render_user(turn)
    # assistant
    reasoning = (turn.reasoning or "") + tk.THINK_END if reasoning_visible else ""
    calls = ""
    if turn.tool_calls:
        calls = "\n\n" + dsml.render_tool_calls([(name, arguments) for name, arguments, _ in turn.tool_calls])
    return reasoning + turn.text + calls + tk.EOS


def _functions_of(tools: list[dict]) -> list[dict]:
    functions = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatEncodingError(f"tools[{index}]: expected {{'type': 'function', 'function': {{'name': ...}}}}")
        functions.append(function)
    return functions


def encode_messages(
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    thinking: bool = False,
    add_bos: bool = True,
    drop_earlier_reasoning: bool = True,
    reasoning_effort: str | None = None,
) -> str:
    """Encode OpenAI-format `messages` (roles system, developer, user, assistant, tool) as
    the DeepSeek-V4 prompt, ending with the generation prompt when the last turn is a user's.

    `tools` are OpenAI tool objects; they are attached to the first system message (one is
    inserted when there is none). `reasoning_effort="max"` prefixes DeepSeek's
    maximum-effort instruction in thinking mode; other values add nothing.
    """
    if not messages:
        raise ChatEncodingError("messages must not be empty")
    turns = _merge_turns(messages)
    if tools:
        functions = _functions_of(tools)
        if turns[0].role != "system":
            turns.insert(0, _Turn(role="system"))
        turns[0].functions = functions
    _order_tool_results(turns)

    drop = drop_earlier_reasoning and not tools
    if thinking and drop:
        turns = _drop_earlier_reasoning(turns)
    last_user = _last_user_index(turns)

    prompt = tk.BOS if add_bos else ""
    if thinking and reasoning_effort == "max":
        prompt += REASONING_EFFORT_MAX_PREFIX
    for index, turn in enumerate(turns):
        # An assistant turn shows its reasoning if thinking is on and either nothing is
        # dropped or it answers the last user turn.
        reasoning_visible = thinking and (not drop or (last_user is not None and index > last_user))
        prompt += _render_turn(turn, reasoning_visible=reasoning_visible)
        next_role = turns[index + 1].role if index + 1 < len(turns) else "assistant"
        if turn.role in ("user", "developer") and next_role == "assistant":
            think_here = thinking and (not drop or index == last_user)
            prompt += tk.ASSISTANT + (tk.THINK_START if think_here else tk.THINK_END)
    return prompt
