"""OpenAI-compatible request bodies: field table, type checks and parsed requests.

The field tables below are the one source of truth: `parse_*` validates against them and
`openapi.py` derives the published schema from them. Unknown fields are ignored (and
logged); a known field with a wrong type or range is a 400 with `param` naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from moemesh.common.sampling_params import SamplingParams

log = structlog.get_logger("router")

MAX_NUM_STOP_STRINGS = 16
MAX_NUM_TOP_LOGPROBS = 20


class ProtocolError(ValueError):
    """A client error with an OpenAI-style body: `{"error": {message, type, param, code}}`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class FieldSpec:
    """One body field: JSON types it may have ("integer", "number", "string", "boolean",
    "array", "object", "null"), an optional numeric range and a description for OpenAPI."""

    name: str
    json_types: tuple[str, ...]
    description: str
    minimum: float | None = None
    maximum: float | None = None
    items: tuple[str, ...] | None = None  # JSON types of array items, when checked here


COMMON_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("model", ("string",), "Model name, as listed by GET /v1/models."),
    FieldSpec("max_tokens", ("integer", "null"), "Most tokens to generate.", minimum=1),
    FieldSpec("temperature", ("number", "null"), "Sampling temperature; 0 is greedy.", 0.0, 2.0),
    FieldSpec("top_p", ("number", "null"), "Nucleus sampling mass.", 0.0, 1.0),
    FieldSpec("top_k", ("integer", "null"), "Keep the k most likely tokens (-1 or null: off).", minimum=-1),
    FieldSpec("min_p", ("number", "null"), "Drop tokens below min_p times the top probability.", 0.0, 1.0),
    FieldSpec("seed", ("integer", "null"), "Seed for reproducible sampling.", -(2**63), 2**64 - 1),
    FieldSpec("n", ("integer", "null"), "Number of choices to generate.", minimum=1),
    FieldSpec("stop", ("string", "array", "null"), "Stop string(s), applied to the text.", items=("string",)),
    FieldSpec("presence_penalty", ("number", "null"), "Presence penalty.", -2.0, 2.0),
    FieldSpec("frequency_penalty", ("number", "null"), "Frequency penalty.", -2.0, 2.0),
    FieldSpec("repetition_penalty", ("number", "null"), "Multiplicative repetition penalty.", minimum=0.0),
    FieldSpec("stream", ("boolean", "null"), "Stream the answer as server-sent events."),
    FieldSpec("stream_options", ("object", "null"), "{include_usage: bool}: a last chunk with usage."),
    FieldSpec("ignore_eos", ("boolean", "null"), "Keep generating past EOS."),
    FieldSpec("user", ("string", "null"), "End-user id (accepted, unused)."),
    FieldSpec("logit_bias", ("object", "null"), "{token id: bias in [-100, 100]} added to the logits."),
    FieldSpec("response_format", ("object", "null"),
              "{type: text | json_object | json_schema, json_schema: {name, schema, strict}}: constrained output."),
)

CHAT_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("messages", ("array",), "The conversation: objects with role and content."),
    *COMMON_FIELDS,
    FieldSpec("max_completion_tokens", ("integer", "null"), "Most tokens to generate (wins over max_tokens).", minimum=1),
    FieldSpec("logprobs", ("boolean", "null"), "Return log probabilities of the chosen tokens."),
    FieldSpec("top_logprobs", ("integer", "null"), "Alternatives per position (needs logprobs).", 0, MAX_NUM_TOP_LOGPROBS),
    FieldSpec("tools", ("array", "null"), "Tools the model may call: {type: function, function: {...}}.", items=("object",)),
    FieldSpec("tool_choice", ("string", "object", "null"), "none, auto, required or a named function."),
    FieldSpec("chat_template_kwargs", ("object", "null"), "{thinking: bool}: thinking on or off."),
    FieldSpec("thinking", ("boolean", "object", "null"), "true/false or {type: enabled|disabled}."),
    FieldSpec("reasoning", ("object", "null"), "{enabled: bool} or {effort: none|low|medium|high|max}."),
    FieldSpec("reasoning_effort", ("string", "null"), "none turns thinking off; max adds the max-effort prompt."),
    FieldSpec("add_special_tokens", ("boolean", "null"),
              "Also add the tokenizer's special tokens (BOS) around the chat prompt; default false, since the "
              "chat encoding starts with its own BOS."),
    FieldSpec("functions", ("array", "null"), "Refused (the deprecated form of tools): use tools."),
    FieldSpec("function_call", ("string", "object", "null"), "Refused (the deprecated form of tool_choice)."),
    FieldSpec("parallel_tool_calls", ("boolean", "null"), "true or null; false (one call at most) is refused."),
    FieldSpec("modalities", ("array", "null"), "Only [\"text\"].", items=("string",)),
    FieldSpec("audio", ("object", "null"), "Refused: the model produces text only."),
    FieldSpec("prediction", ("object", "null"), "Refused: predicted outputs are not supported."),
    FieldSpec("web_search_options", ("object", "null"), "Refused: no web search."),
    FieldSpec("store", ("boolean", "null"), "false or null; nothing is stored, so true is refused."),
    FieldSpec("metadata", ("object", "null"), "Accepted with store absent or false (it tags stored answers)."),
    FieldSpec("service_tier", ("string", "null"), "auto, default or null; other tiers are refused."),
)

COMPLETION_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("prompt", ("string", "array"), "A string, a list of strings, token ids or lists of token ids."),
    *COMMON_FIELDS,
    FieldSpec("logprobs", ("integer", "null"), "Return this many alternatives per token (0: chosen only).", 0, MAX_NUM_TOP_LOGPROBS),
    FieldSpec("add_special_tokens", ("boolean", "null"),
              "Add the tokenizer's special tokens (BOS) to a text prompt as its configuration says (default "
              "true); token-id prompts are taken as given."),
    FieldSpec("echo", ("boolean", "null"), "Put the prompt before each choice's text (not with logprobs)."),
    FieldSpec("best_of", ("integer", "null"), "Only null or equal to n: server-side best-of is refused.", minimum=1),
    FieldSpec("suffix", ("string", "null"), "Refused unless null or empty: no insertion (fill-in-the-middle)."),
)

_TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _check_field(spec: FieldSpec, value: Any) -> None:
    if not any(_TYPE_CHECKS[t](value) for t in spec.json_types):
        raise ProtocolError(f"'{spec.name}' must be of type {' or '.join(spec.json_types)}", param=spec.name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value != value or (spec.minimum is not None and value < spec.minimum) or (
            spec.maximum is not None and value > spec.maximum
        ):
            raise ProtocolError(f"'{spec.name}' must be in [{spec.minimum}, {spec.maximum}], got {value}", param=spec.name)
    if spec.items and isinstance(value, list):
        for item in value:
            if not any(_TYPE_CHECKS[t](item) for t in spec.items):
                raise ProtocolError(f"items of '{spec.name}' must be {' or '.join(spec.items)}", param=spec.name)


# A JSON string token (escapes included); what lies between such tokens is structure.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_TO_PARENS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_DEPTH_CHUNK = 1 << 22


MAX_JSON_CONTAINERS = 65_536  # arrays + objects in one body
MAX_JSON_STRINGS = 262_144  # strings (keys included) in one body
MAX_JSON_VALUES = 2_097_152  # values of all kinds in one body: room for two 1M-token id prompts


@dataclass(frozen=True)
class JsonShape:
    """What a scan of the raw bytes tells about a JSON text before it is parsed."""

    too_deep: bool
    num_containers: int
    num_strings: int
    num_values_at_least: int  # one more than the commas between values


def json_shape(raw: bytes, max_depth: int) -> JsonShape:
    """Nesting beyond `max_depth` and the number of arrays / objects and strings, found without
    parsing: strings are cut out (a bracket inside one is text), the rest is reduced to its
    brackets, and the running depth of those is scanned in C (bytes and numpy), a few MiB at a
    time. Unbalanced brackets may read as deep; such a body is not valid JSON either way.
    The counts bound what parsing costs: `json.loads` holds the GIL for its whole run, and its
    time grows with the number of values, not with the length of a long string."""
    without_strings, num_strings = _JSON_STRING.subn(b"", raw)
    brackets = without_strings.translate(_TO_PARENS, _NOT_BRACKETS)
    num_containers = brackets.count(b"(")
    return JsonShape(_nests_deeper(brackets, max_depth), num_containers, num_strings,
                     without_strings.count(b",") + 1)


def nesting_exceeds(raw: bytes, max_depth: int) -> bool:
    return json_shape(raw, max_depth).too_deep


def _nests_deeper(brackets: bytes, max_depth: int) -> bool:
    """Whether a string of ( and ) reaches a running depth above `max_depth`."""
    if b"(" * (max_depth + 1) in brackets:
        return True
    num_levels_removed = 0
    for _ in range(2):  # drop innermost pairs (one level each): lists of short lists vanish here
        shorter = brackets.replace(b"()", b"")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
        num_levels_removed += 1
    if num_levels_removed > max_depth:
        return True
    depth = num_levels_removed
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        chunk = np.frombuffer(brackets, np.uint8, count=min(_DEPTH_CHUNK, len(brackets) - start), offset=start)
        running = np.cumsum(81 - 2 * chunk.astype(np.int32)) + depth  # "(" is 40 -> +1, ")" is 41 -> -1
        if int(running.max()) > max_depth:
            return True
        depth = int(running[-1])
    return False


def decode_body(raw: bytes, *, max_depth: int) -> dict:
    """Bytes -> JSON object; invalid UTF-8 (including lone surrogates), bad JSON, nesting
    deeper than `max_depth` and more values than MAX_JSON_CONTAINERS / _STRINGS / _VALUES
    (both checked before parsing) are 400s."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ProtocolError(f"request body is not valid UTF-8: {error.reason} at byte {error.start}") from None
    # every unescaped quote opens or closes a string: a lower bound on the strings, counted in C
    # before the scan below, whose regular expression holds the GIL for as long as it runs
    num_strings_at_least = (raw.count(b'"') - raw.count(b'\\"')) // 2
    if num_strings_at_least > MAX_JSON_STRINGS:
        raise ProtocolError(f"request body holds at least {num_strings_at_least} strings; at most {MAX_JSON_STRINGS}",
                            code="too_many_values")
    shape = json_shape(raw, max_depth)
    if shape.too_deep:
        raise ProtocolError(f"request body nests arrays and objects deeper than {max_depth} levels",
                            code="nesting_too_deep")
    if (shape.num_containers > MAX_JSON_CONTAINERS or shape.num_strings > MAX_JSON_STRINGS
            or shape.num_values_at_least > MAX_JSON_VALUES):
        raise ProtocolError(f"request body holds {shape.num_containers} arrays / objects, {shape.num_strings} strings "
                            f"and at least {shape.num_values_at_least} values; at most {MAX_JSON_CONTAINERS}, "
                            f"{MAX_JSON_STRINGS} and {MAX_JSON_VALUES}", code="too_many_values")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ProtocolError(f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # only a \uD800-\uDFFF escape can make a lone surrogate
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError("request body contains invalid Unicode (a lone surrogate escape)") from None
    return body


def check_fields(body: dict, specs: tuple[FieldSpec, ...], *, endpoint: str) -> None:
    known = {spec.name: spec for spec in specs}
    unknown = sorted(set(body) - set(known))
    if unknown:
        log.warning("router.unknown_fields", endpoint=endpoint, fields=unknown)
    for name, spec in known.items():
        if name in body:
            _check_field(spec, body[name])


@dataclass(frozen=True)
class CommonOptions:
    """What both endpoints share, before the prompt is tokenized (max_tokens may be None)."""

    model: str | None
    max_tokens: int | None
    num_choices: int
    stream: bool
    include_usage: bool
    stop_strings: tuple[str, ...]
    seed: int | None
    sampling_fields: dict  # keyword arguments of SamplingParams except max_tokens / num_logprobs
    max_tokens_param: str = "max_tokens"  # the field the client set the token budget with
    response_format: Any = None  # guided_decoding.ResponseFormat when the output is constrained

    def sampling_params(self, *, max_tokens: int, num_logprobs: int | None, seed: int | None,
                        stop_token_ids: tuple[int, ...]) -> SamplingParams:
        fields = dict(self.sampling_fields, seed=seed)
        return SamplingParams(max_tokens=max_tokens, num_logprobs=num_logprobs, stop_token_ids=stop_token_ids, **fields)


def parse_common(body: dict, *, max_num_choices: int, default_temperature: float, max_tokens_field: str | None) -> CommonOptions:
    def get(name, default=None):
        value = body.get(name)
        return default if value is None else value

    max_tokens = body.get(max_tokens_field) if max_tokens_field else None
    max_tokens_param = max_tokens_field if max_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    num_choices = get("n", 1)
    if num_choices > max_num_choices:
        raise ProtocolError(f"'n' must be at most {max_num_choices}", param="n")
    stop = get("stop", [])
    stop_strings = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stop_strings) or len(stop_strings) > MAX_NUM_STOP_STRINGS:
        raise ProtocolError(f"'stop' takes 1 to {MAX_NUM_STOP_STRINGS} non-empty strings", param="stop")
    stream = bool(get("stream", False))
    stream_options = get("stream_options", {})
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ProtocolError("'stream_options.include_usage' must be a boolean", param="stream_options")
    top_k = get("top_k")
    fields = {
        "temperature": float(get("temperature", default_temperature)),
        "top_p": float(get("top_p", 1.0)),
        "top_k": None if top_k in (None, -1, 0) else top_k,
        "min_p": float(get("min_p", 0.0)),
        "presence_penalty": float(get("presence_penalty", 0.0)),
        "frequency_penalty": float(get("frequency_penalty", 0.0)),
        "repetition_penalty": float(get("repetition_penalty", 1.0)),
        "ignore_eos": bool(get("ignore_eos", False)),
    }
    try:  # SamplingParams holds the range rules (e.g. top_p in (0, 1])
        SamplingParams(max_tokens=1, **fields)
    except ValueError as error:
        raise ProtocolError(str(error), param=str(error).split(" ", 1)[0]) from None
    return CommonOptions(
        model=body.get("model"),
        max_tokens=max_tokens,
        num_choices=num_choices,
        stream=stream,
        include_usage=stream and include_usage,
        stop_strings=stop_strings,
        seed=body.get("seed"),
        sampling_fields=fields,
        max_tokens_param=max_tokens_param,
    )
