"""The streaming client of `moemesh bench serve`: one OpenAI-style request, timed chunk by chunk.

Timing follows `vllm bench serve`: the clock starts just before the request is written and
every server-sent event is stamped when its line is read. The first event with choices is
the first token (TTFT); each later event that carries output (text, reasoning, tool calls)
adds one inter-token gap (ITL), so with speculative decoding one gap may cover several
tokens. An event with only a finish reason carries no token and adds no gap. Token counts
come from the server's usage chunk (`stream_options.include_usage`), never from counting
events.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from moemesh.bench.serve_workload import WorkloadRequest

FAILED_FINISH_REASONS = frozenset({"error", "abort"})
MAX_ERROR_CHARS = 300


class Endpoint(enum.Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self is Endpoint.CHAT else "/v1/completions"


@dataclass(frozen=True)
class RequestOptions:
    """Body fields every request shares."""

    model: str
    temperature: float | None = None  # None: the server's default
    ignore_eos: bool = False


@dataclass
class RequestRecord:
    """What one request measured. Times are `time.perf_counter()` seconds; `chunk_times_s`
    are the arrival times of the first event and of every later event that carried output."""

    index: int
    start_s: float
    end_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None  # from usage; None when the server sent none
    num_output_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    usage_reported: bool = False  # False: no usage chunk; output tokens counted as events instead

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def e2el_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1): the mean time per token after the first;
        None with fewer than two output tokens (there is no decode phase to time)."""
        if self.num_output_tokens is None or self.num_output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.num_output_tokens - 1)


def build_body(endpoint: Endpoint, request: WorkloadRequest, options: RequestOptions) -> dict:
    """The JSON body: streaming with usage, the workload's max_tokens, and the shared options.
    A text prompt on the chat endpoint becomes one user message; chat messages on the
    completions endpoint are joined into one prompt text (their contents, one per line)."""
    body: dict = {"model": options.model, "max_tokens": request.max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint is Endpoint.CHAT:
        body["messages"] = list(request.messages) if request.messages else [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt if request.prompt is not None else "\n".join(
            str(m.get("content", "")) for m in request.messages)
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.ignore_eos:
        body["ignore_eos"] = True
    return body


def _has_output(choice: dict) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
    return bool(choice.get("text"))


def _error_text(status: int, raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    return f"HTTP {status}: {message}"[:MAX_ERROR_CHARS]


def _read_event(record: RequestRecord, payload: dict, arrived_s: float) -> None:
    if isinstance(payload.get("error"), dict):
        record.error = f"error event: {payload['error'].get('message')}"[:MAX_ERROR_CHARS]
        return
    usage = payload.get("usage")
    if isinstance(usage, dict):
        record.usage_reported = True
        record.num_prompt_tokens = usage.get("prompt_tokens")
        record.num_output_tokens = usage.get("completion_tokens")
    for choice in payload.get("choices") or ():
        if not record.chunk_times_s or _has_output(choice):
            record.chunk_times_s.append(arrived_s)
            break
    for choice in payload.get("choices") or ():
        record.finish_reason = choice.get("finish_reason") or record.finish_reason


async def send_request(client: httpx.AsyncClient, index: int, endpoint: Endpoint, body: dict,
                       on_first_token: Callable[[], None] | None = None) -> RequestRecord:
    """Send one streaming request and time it. Never raises for a failed request: the failure
    is in `record.error` (HTTP status, transport error, an error finish reason, or a stream
    that ended before `[DONE]`). on_first_token: called once when the first token's event arrives."""
    record = RequestRecord(index=index, start_s=time.perf_counter())
    done = False
    try:
        async with client.stream("POST", endpoint.path, json=body) as response:
            if response.status_code != 200:
                record.error = _error_text(response.status_code, await response.aread())
                return record
            async for line in response.aiter_lines():
                arrived_s = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators and ": keep-alive" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    record.end_s, done = arrived_s, True
                    break
                _read_event(record, json.loads(data), arrived_s)
                if on_first_token is not None and record.chunk_times_s:
                    on_first_token()
                    on_first_token = None
                if record.error is not None:
                    return record
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as error:  # transport or malformed events
        record.error = f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]
        return record
    if not done:
        record.error = "stream ended before [DONE]"
    elif record.finish_reason in FAILED_FINISH_REASONS:
        record.error = f"finish_reason={record.finish_reason}"
    elif not record.chunk_times_s:
        record.error = "stream carried no output"
    elif record.num_output_tokens is None:  # the server ignored include_usage: one token per event
        record.num_output_tokens = len(record.chunk_times_s)
    return record


async def first_model(client: httpx.AsyncClient) -> str:
    """The first model `GET /v1/models` lists (the default of --model)."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models lists no model; pass --model")
    return models[0]["id"]
