"""Streaming parser of DeepSeek-V4 chat output: reasoning, content and DSML tool calls.

Text arrives in arbitrary pieces (whatever the detokenizer released). The parser never
emits part of a marker: any tail of the buffer that could still grow into `</think>`, the
tool-call block opener or EOS is held back until the next piece decides it. Feeding the
same text one character at a time or all at once yields the same concatenated result
(same reasoning, same content, same tool calls with the same ids).

Phases: REASONING (thinking on; the prompt already ended with `<think>`) until `</think>`,
then CONTENT until `\\n\\n<｜DSML｜tool_calls>` or EOS, then TOOL_CALLS, where each complete
`<｜DSML｜invoke ...>...</｜DSML｜invoke>` becomes one OpenAI tool call, until the block
closes. Text after the block counts as content again. EOS ends everything.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import structlog

from moemesh.common.chat import tokens as tk
from moemesh.common.chat.dsml import DsmlFormatError, parse_invoke

log = structlog.get_logger("chat")


@dataclass(frozen=True)
class ToolCall:
    """One tool call in OpenAI's shape: `index` is its position among this output's calls."""

    index: int
    id: str
    name: str
    arguments: str  # JSON object text

    def to_openai(self) -> dict:
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Delta:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)

    def is_empty(self) -> bool:
        return not (self.content or self.reasoning_content or self.tool_calls)


class _Phase(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL_CALLS = "tool_calls"
    DONE = "done"


_TOOL_OPENERS = (tk.TOOL_CALLS_OPEN, tk.LEGACY_TOOL_CALLS_OPEN)
_TOOL_CLOSERS = (tk.TOOL_CALLS_CLOSE, tk.LEGACY_TOOL_CALLS_CLOSE)
_REASONING_MARKERS = (tk.THINK_END, *_TOOL_OPENERS, tk.EOS)
_CONTENT_MARKERS = (*_TOOL_OPENERS, tk.EOS)
# Held back in content: the blank line that precedes a tool-call block belongs to the block.
_CONTENT_HOLD = (*("\n\n" + opener for opener in _TOOL_OPENERS), *_CONTENT_MARKERS)


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for marker in markers:
        position = text.find(marker)
        if position >= 0 and (best is None or position < best[0]):
            best = (position, marker)
    return best


def _held_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some marker."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:length]):
                longest = length
                break
    return longest


class ChatOutputParser:
    """Feed text deltas, get `Delta`s; call `finish()` once at the end for the held tail."""

    def __init__(self, thinking: bool, *, tools_enabled: bool = True, tool_call_id_prefix: str = "call_") -> None:
        self._phase = _Phase.REASONING if thinking else _Phase.CONTENT
        self._tools_enabled = tools_enabled
        self._id_prefix = tool_call_id_prefix
        self._pending = ""
        self._at_reasoning_start = thinking
        self._num_tool_calls = 0

    @property
    def num_tool_calls(self) -> int:
        return self._num_tool_calls

    def feed(self, text_delta: str) -> Delta:
        self._pending += text_delta
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        while self._step(content, reasoning, calls):
            pass
        return Delta("".join(content), "".join(reasoning), tuple(calls))

    def finish(self) -> Delta:
        """Release whatever was held back; an unfinished tool-call block becomes content."""
        delta = self.feed("")
        rest, self._pending = self._pending, ""
        phase, self._phase = self._phase, _Phase.DONE
        if phase is _Phase.REASONING:
            return Delta(delta.content, delta.reasoning_content + rest, delta.tool_calls)
        if phase is _Phase.TOOL_CALLS and rest.strip():
            log.warning("chat.unfinished_tool_call_block", num_chars=len(rest))
            return Delta(delta.content + rest, delta.reasoning_content, delta.tool_calls)
        if phase is _Phase.CONTENT:
            return Delta(delta.content + rest, delta.reasoning_content, delta.tool_calls)
        return delta

    # One transition per call; returns True while progress can still be made.
    def _step(self, content: list[str], reasoning: list[str], calls: list[ToolCall]) -> bool:
        if self._phase is _Phase.REASONING:
            return self._step_reasoning(reasoning)
        if self._phase is _Phase.CONTENT:
            return self._step_content(content)
        if self._phase is _Phase.TOOL_CALLS:
            return self._step_tool_calls(content, calls)
        self._pending = ""  # DONE: anything after EOS is ignored
        return False

    def _step_reasoning(self, reasoning: list[str]) -> bool:
        if self._at_reasoning_start:
            # Tolerate a model that repeats the `<think>` the prompt already ends with.
            if tk.THINK_START.startswith(self._pending) and self._pending != tk.THINK_START:
                return False
            if self._pending.startswith(tk.THINK_START):
                self._pending = self._pending[len(tk.THINK_START) :]
            self._at_reasoning_start = False
        found = _earliest(self._pending, _REASONING_MARKERS)
        if found is None:
            held = _held_length(self._pending, _REASONING_MARKERS)
            reasoning.append(self._pending[: len(self._pending) - held])
            self._pending = self._pending[len(self._pending) - held :]
            return False
        position, marker = found
        reasoning.append(self._pending[:position])
        if marker == tk.THINK_END:
            self._pending = self._pending[position + len(marker) :]
            self._phase = _Phase.CONTENT
        elif marker == tk.EOS:
            self._phase = _Phase.DONE
        else:  # a tool-call block straight out of reasoning: let the content phase take it
            self._pending = self._pending[position:]
            self._phase = _Phase.CONTENT
        return True

    def _step_content(self, content: list[str]) -> bool:
        markers = _CONTENT_MARKERS if self._tools_enabled else (tk.EOS,)
        found = _earliest(self._pending, markers)
        if found is None:
            held = _held_length(self._pending, _CONTENT_HOLD if self._tools_enabled else markers)
            content.append(self._pending[: len(self._pending) - held])
            self._pending = self._pending[len(self._pending) - held :]
            return False
        position, marker = found
        before = self._pending[:position]
        if marker == tk.EOS:
            content.append(before)
            self._phase = _Phase.DONE
            return True
        content.append(before[:-2] if before.endswith("\n\n") else before)
        self._pending = self._pending[position + len(marker) :]
        self._phase = _Phase.TOOL_CALLS
        return True

    def _step_tool_calls(self, content: list[str], calls: list[ToolCall]) -> bool:
        stripped = self._pending.lstrip()
        for closer in _TOOL_CLOSERS:
            if stripped.startswith(closer):
                self._pending = stripped[len(closer) :]
                self._phase = _Phase.CONTENT
                return True
        end = self._pending.find(tk.INVOKE_CLOSE)
        if end < 0:
            return False
        end += len(tk.INVOKE_CLOSE)
        invoke_text, self._pending = self._pending[:end], self._pending[end:]
        try:
            parsed = parse_invoke(invoke_text)
        except DsmlFormatError as error:
            log.warning("chat.bad_tool_call", error=str(error))
            content.append(invoke_text)
            return True
        calls.append(
            ToolCall(
                index=self._num_tool_calls,
                id=f"{self._id_prefix}{self._num_tool_calls}",
                name=parsed.name,
                arguments=parsed.arguments_json,
            )
        )
        self._num_tool_calls += 1
        return True
