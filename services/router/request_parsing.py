"""Parsed chat and completion requests (validation beyond field types lives here)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import jsonschema

from moemesh.services.router.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    CommonOptions,
    ProtocolError,
    check_fields,
    parse_common,
)
from moemesh.services.router.guided_decoding import parse_logit_bias, parse_response_format


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
    add_special_tokens: bool = False  # the tokenizer's BOS on top of the chat encoding's own


@dataclass(frozen=True)
class CompletionRequest:
    options: CommonOptions
    prompts: list[str | list[int]]  # each prompt is text or token ids
    num_logprobs: int | None
    add_special_tokens: bool = True  # text prompts get the tokenizer's special tokens (BOS)
    echo: bool = False  # each choice's text starts with its prompt


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


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _check_tools(tools: list[dict]) -> list[str]:
    """Each tool is {type: function, function: {name, description?, parameters?}} with a valid
    JSON Schema as parameters (checked against its metaschema); returns the function names."""
    names: list[str] = []
    for index, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or not isinstance(
            function.get("name"), str
        ):
            raise ProtocolError(f"tools[{index}] must be {{type: function, function: {{name, ...}}}}", param=f"tools[{index}]")
        name = function["name"]
        if not _FUNCTION_NAME.match(name) or name in names:
            raise ProtocolError(f"tools[{index}].function.name must be 1 to 64 letters, digits, _ or - and unique",
                                param=f"tools[{index}].function.name")
        if not isinstance(function.get("description") or "", str):
            raise ProtocolError(f"tools[{index}].function.description must be a string",
                                param=f"tools[{index}].function.description")
        parameters = function.get("parameters")
        if parameters is not None:
            _check_json_schema(parameters, f"tools[{index}].function.parameters")
        names.append(name)
    return names


def _check_json_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, (dict, bool)):
        raise ProtocolError(f"{param} must be a JSON Schema (an object)", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as error:
        where = "/".join(str(part) for part in error.path) or "the root"
        raise ProtocolError(f"{param} is not a valid JSON Schema: {error.message[:200]} (at {where})",
                            param=param) from None
    except (RecursionError, ValueError, TypeError) as error:  # a $schema / $ref the validator cannot use
        raise ProtocolError(f"{param} is not a usable JSON Schema: {str(error)[:200]}", param=param) from None


def _check_tool_choice(tool_choice: Any, tool_names: list[str]) -> None:
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ProtocolError("'tool_choice' must be none, auto, required or a named function", param="tool_choice")
        if tool_choice == "required" and not tool_names:
            raise ProtocolError("'tool_choice' required needs tools", param="tool_choice")
        if tool_choice == "required":
            raise ProtocolError("'tool_choice' required is not supported: tool calls are not forced; use auto",
                                param="tool_choice", code="unsupported_parameter")
        return
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ProtocolError("'tool_choice' must be {type: function, function: {name}}", param="tool_choice")
        if name not in tool_names:
            raise ProtocolError(f"'tool_choice' names the function {name[:64]!r}, which is not among the tools",
                                param="tool_choice")
        raise ProtocolError("'tool_choice' naming a function is not supported: tool calls are not forced; use auto",
                            param="tool_choice", code="unsupported_parameter")


def _refuse_unsupported(body: dict, refusals: tuple[tuple[str, Any, str], ...]) -> None:
    """Known OpenAI fields this server does not implement: a 400 naming the field unless the
    value asks for nothing (`accepts(value)`)."""
    for name, accepts, why in refusals:
        value = body.get(name)
        if value is not None and not accepts(value):
            raise ProtocolError(f"'{name}' is not supported: {why}", param=name, code="unsupported_parameter")


_CHAT_REFUSALS = (
    ("functions", lambda v: False, "use 'tools'"),
    ("function_call", lambda v: False, "use 'tool_choice'"),
    ("parallel_tool_calls", lambda v: v is True, "the model may always call several tools"),
    ("modalities", lambda v: v == ["text"], "the model produces text only"),
    ("audio", lambda v: False, "the model produces text only"),
    ("prediction", lambda v: False, "predicted outputs are not implemented"),
    ("web_search_options", lambda v: False, "there is no web search"),
    ("store", lambda v: v is False, "nothing is stored"),
    ("service_tier", lambda v: v in ("auto", "default"), "there is one service tier"),
)


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
    _refuse_unsupported(body, _CHAT_REFUSALS)
    if "messages" not in body:
        raise ProtocolError("'messages' is required", param="messages")
    _check_messages(body["messages"])
    options = parse_common(body, max_num_choices=max_num_choices, default_temperature=default_temperature,
                           max_tokens_field="max_completion_tokens")
    options = _with_output_controls(options, body, vocab_size)
    tools = body.get("tools") or None
    tool_names = _check_tools(tools) if tools else []
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        _check_tool_choice(tool_choice, tool_names)
    if tool_choice == "none":
        tools = None
    num_logprobs = None
    if body.get("logprobs"):
        num_logprobs = body.get("top_logprobs") or 0
    elif body.get("top_logprobs"):
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    thinking, effort = _thinking_choice(body, default_thinking)
    return ChatRequest(options, body["messages"], tools, thinking, effort, num_logprobs,
                       add_special_tokens=bool(body.get("add_special_tokens") or False))


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
                             max_num_prompts: int = 256, vocab_size: int) -> CompletionRequest:
    check_fields(body, COMPLETION_FIELDS, endpoint="completions")
    if "prompt" not in body:
        raise ProtocolError("'prompt' is required", param="prompt")
    prompts = _check_prompt(body["prompt"])
    if len(prompts) > max_num_prompts:
        raise ProtocolError(f"'prompt' holds {len(prompts)} prompts; at most {max_num_prompts} per request",
                            param="prompt")
    options = parse_common(body, max_num_choices=max_num_choices, default_temperature=default_temperature,
                           max_tokens_field=None)
    options = _with_output_controls(options, body, vocab_size)
    if body.get("suffix"):
        raise ProtocolError("'suffix' is not supported: no insertion (fill-in-the-middle) prompts",
                            param="suffix", code="unsupported_parameter")
    best_of = body.get("best_of")
    if best_of is not None and best_of != options.num_choices:
        raise ProtocolError("'best_of' must be null or equal to n: server-side best-of is not supported",
                            param="best_of", code="unsupported_parameter")
    echo = bool(body.get("echo") or False)
    if echo and body.get("logprobs") is not None:
        raise ProtocolError("'echo' with 'logprobs' needs prompt logprobs, which are not computed", param="echo",
                            code="unsupported_parameter")
    add_special_tokens = body.get("add_special_tokens")
    return CompletionRequest(options, prompts, body.get("logprobs"),
                             add_special_tokens=True if add_special_tokens is None else add_special_tokens, echo=echo)
