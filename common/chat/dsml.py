"""DSML: how DeepSeek-V4 writes tool definitions and tool calls as text.

A tool-call block, as the model writes it (and as we render earlier calls back into prompts):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String values are written as they are (`string="true"`); every other JSON value is written
as JSON (`string="false"`). Parsing turns each invoke back into a name and a JSON object of
arguments, which is what OpenAI's `tool_calls[].function.arguments` carries.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from moemesh.common.chat import tokens as tk

_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value: Any) -> str:
    """JSON the way the encoding writes it: non-ASCII characters kept as they are."""
    return json.dumps(value, ensure_ascii=False)


def render_tools_section(functions: list[dict]) -> str:
    """The system-prompt section that lists the tools; one JSON schema per line."""
    return _TOOLS_SECTION.format(
        dsml=tk.DSML,
        think_start=tk.THINK_START,
        think_end=tk.THINK_END,
        schemas="\n".join(to_json(function) for function in functions),
    )


def _arguments_as_object(arguments: Any) -> dict:
    """OpenAI carries arguments as a JSON string; an unparsable string becomes one field."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": arguments}


def render_invoke(name: str, arguments: Any) -> str:
    params = []
    for key, value in _arguments_as_object(arguments).items():
        is_string = isinstance(value, str)
        text = value if is_string else to_json(value)
        params.append(
            f'{tk.PARAMETER_OPEN_PREFIX} name="{key}" string="{"true" if is_string else "false"}">'
            f"{text}{tk.PARAMETER_CLOSE}"
        )
    body = "\n".join(params)
    return f'{tk.INVOKE_OPEN_PREFIX} name="{name}">\n{body}\n{tk.INVOKE_CLOSE}'


def render_tool_calls(calls: list[tuple[str, Any]]) -> str:
    """A whole block for (name, arguments) pairs, without the blank line that precedes it."""
    invokes = "\n".join(render_invoke(name, arguments) for name, arguments in calls)
    return f"{tk.TOOL_CALLS_OPEN}\n{invokes}\n{tk.TOOL_CALLS_CLOSE}"


@dataclass(frozen=True)
class ParsedInvoke:
    name: str
    arguments_json: str  # a JSON object, as OpenAI's function.arguments


class DsmlFormatError(ValueError):
    """An invoke block the model wrote that does not follow the DSML grammar."""


_INVOKE_RE = re.compile(
    re.escape(tk.INVOKE_OPEN_PREFIX) + r'\s+name="(?P<name>[^"]*)"\s*>(?P<body>.*?)' + re.escape(tk.INVOKE_CLOSE),
    re.DOTALL,
)
_PARAMETER_RE = re.compile(
    re.escape(tk.PARAMETER_OPEN_PREFIX)
    + r'\s+name="(?P<name>[^"]*)"\s+string="(?P<string>true|false)"\s*>(?P<value>.*?)'
    + re.escape(tk.PARAMETER_CLOSE),
    re.DOTALL,
)


def parse_invoke(text: str) -> ParsedInvoke:
    """Parse one complete `<｜DSML｜invoke ...>...</｜DSML｜invoke>` string.

    A `string="false"` value that is not valid JSON is kept as a string rather than
    failing the whole call: the client sees what the model wrote.
    """
    match = _INVOKE_RE.fullmatch(text.strip())
    if match is None:
        raise DsmlFormatError(f"not a DSML invoke: {text[:80]!r}")
    arguments: dict[str, Any] = {}
    body = match.group("body")
    position = 0
    for parameter in _PARAMETER_RE.finditer(body):
        if body[position : parameter.start()].strip():
            raise DsmlFormatError(f"stray text in invoke: {body[position:parameter.start()][:80]!r}")
        position = parameter.end()
        value_text = parameter.group("value")
        if parameter.group("string") == "true":
            value: Any = value_text
        else:
            try:
                value = json.loads(value_text)
            except ValueError:
                value = value_text
        arguments[parameter.group("name")] = value
    if body[position:].strip():
        raise DsmlFormatError(f"stray text in invoke: {body[position:][:80]!r}")
    return ParsedInvoke(name=match.group("name"), arguments_json=to_json(arguments))
