"""Parsed chat and completion requests (validation beyond field types lives here)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from services.router.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    CommonOptions,
    ProtocolError,
    check_fields,
    parse_common,
)
from services.router.guided_decoding import parse_logit_bias, parse_response_format


def _with_output_controls(options: CommonOptions, body: dict, vocab_size: int) -> CommonOptions:
    """logit_bias and response_format (validated in guided_decoding.py) added to the options."""
    fields = dict(options.sampling_fields, logit_bias=parse_logit_bias(body.get("logit_bias"), vocab_size))
    return replace(options, sampling_fields=fields, response_format=parse_response_format(body.get("response_format")))


_MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
_THINKING_OFF_EFFORTS = ("none",)
_EFFORTS = ("none", "minimal", "low", "medium", "high", "max")


@dataclass(frozen=True)
class ChatRequest:
    options: CommonOptions
    messages: list[dict]
    tools: list[dict] | None  # None when absent or tool_choice is "none"
    thinking: bool
    reasoning_effort: str | None
    num_logprobs: int | None  # None: no logprobs; k: chosen token plus k alternatives


@dataclass(frozen=True)
class CompletionRequest:
    options: CommonOptions
    prompts: list[str | list[int]]  # each prompt is text or token ids
    num_logprobs: int | None


def _check_messages(messages: list) -> None:
    if not messages:
        raise ProtocolError("'messages' must not be empty", param="messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ProtocolError(f"{where} must be an object", param=where)
        if message.get("role") not in _MESSAGE_ROLES:
            raise ProtocolError(f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}", param=f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ProtocolError(f"{where}.content must be a string, a list of parts or null", param=f"{where}.content")
        if message["role"] == "user" and content is None:
            raise ProtocolError(f"{where}.content is required for a user message", param=f"{where}.content")
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id", ""), str):
            raise ProtocolError(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise ProtocolError(f"{where}.tool_calls must be an array", param=f"{where}.tool_calls")


def _check_tools(tools: list[dict]) -> None:
    for index, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or not isinstance(
            function.get("name"), str
        ):
            raise ProtocolError(f"tools[{index}] must be {{type: function, function: {{name, ...}}}}", param=f"tools[{index}]")


def _thinking_choice(body: dict, default: bool) -> tuple[bool, str | None]:
    """Thinking on/off from the first of: chat_template_kwargs, thinking, reasoning,
    reasoning_effort; the effort string is returned for the max-effort prompt."""
    effort = body.get("reasoning_effort")
    reasoning = body.get("reasoning") or {}
    if effort is None and isinstance(reasoning.get("effort"), str):
        effort = reasoning["effort"]
    if effort is not None and effort not in _EFFORTS:
        raise ProtocolError(f"reasoning effort must be one of {', '.join(_EFFORTS)}", param="reasoning_effort")
    kwargs = body.get("chat_template_kwargs") or {}
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise ProtocolError(f"'chat_template_kwargs.{key}' must be a boolean", param="chat_template_kwargs")
            return kwargs[key], effort
    thinking = body.get("thinking")
    if isinstance(thinking, bool):
        return thinking, effort
    if isinstance(thinking, dict):
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise ProtocolError("'thinking.type' must be enabled or disabled", param="thinking")
        return kind == "enabled", effort
    if "enabled" in reasoning:
        if not isinstance(reasoning["enabled"], bool):
            raise ProtocolError("'reasoning.enabled' must be a boolean", param="reasoning")
        return reasoning["enabled"], effort
    if effort is not None:
        return effort not in _THINKING_OFF_EFFORTS, effort
    return default, effort


def parse_chat_request(body: dict, *, max_num_choices: int, default_temperature: float,
                       default_thinking: bool, vocab_size: int) -> ChatRequest:
    check_fields(body, CHAT_FIELDS, endpoint="chat")
    if "messages" not in body:
        raise ProtocolError("'messages' is required", param="messages")
    _check_messages(body["messages"])
    options = parse_common(body, max_num_choices=max_num_choices, default_temperature=default_temperature,
                           max_tokens_field="max_completion_tokens")
    options = _with_output_controls(options, body, vocab_size)
    tools = body.get("tools") or None
    if tools:
        _check_tools(tools)
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise ProtocolError("'tool_choice' must be none, auto, required or a named function", param="tool_choice")
    if tool_choice == "none":
        tools = None
    num_logprobs = None
    if body.get("logprobs"):
        num_logprobs = body.get("top_logprobs") or 0
    elif body.get("top_logprobs"):
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    thinking, effort = _thinking_choice(body, default_thinking)
    return ChatRequest(options, body["messages"], tools, thinking, effort, num_logprobs)


def _check_prompt(prompt: Any) -> list[str | list[int]]:
    def is_ids(value):
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str):
        prompts = [prompt]
    elif is_ids(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise ProtocolError("'prompt' must be a string, a list of strings, token ids or lists of token ids", param="prompt")
    if any(len(p) == 0 for p in prompts):
        raise ProtocolError("'prompt' must not be empty", param="prompt")
    return prompts


def parse_completion_request(body: dict, *, max_num_choices: int, default_temperature: float,
                             vocab_size: int) -> CompletionRequest:
    check_fields(body, COMPLETION_FIELDS, endpoint="completions")
    if "prompt" not in body:
        raise ProtocolError("'prompt' is required", param="prompt")
    prompts = _check_prompt(body["prompt"])
    options = parse_common(body, max_num_choices=max_num_choices, default_temperature=default_temperature,
                           max_tokens_field=None)
    options = _with_output_controls(options, body, vocab_size)
    return CompletionRequest(options, prompts, body.get("logprobs"))
