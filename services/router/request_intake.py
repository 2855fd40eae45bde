"""A generation request from HTTP body to prompt token ids: read, parse, admit, tokenize.

Hostile input costs little: a body over `max_body_bytes` is refused from its Content-Length
(or as it streams in), nesting deeper than `max_json_depth` before parsing, a prompt that
cannot fit the context from its byte count before tokenizing (prompt_tokens.py: only where
the tokenizer bounds the bytes per token). Large bodies are parsed and long prompts tokenized
in worker threads, at most `max_concurrent_tokenizations` at once, so the event loop (and
`/health`) stays responsive. Overload is refused (`Overloaded`) before tokenizing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import anyio
from starlette.requests import Request
from tokenizers import Tokenizer

from moemesh.common.chat import ChatEncodingError, encode_messages
from moemesh.services.router.engine_client import EngineClient
from moemesh.services.router.gateway_config import GatewayConfig
from moemesh.services.router.prompt_tokens import prompt_tokens_for
from moemesh.services.router.protocol import CommonOptions, ProtocolError, decode_body
from moemesh.services.router.request_parsing import (
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)


@dataclass(frozen=True)
class RequestPlan:
    """Everything needed to run one accepted request."""

    endpoint: str  # "chat" | "completions"
    response_id: str
    model: str
    options: CommonOptions
    prompt_ids: list[list[int]]
    num_logprobs: int | None
    thinking: bool = False
    tools_enabled: bool = False
    prompt_param: str = "messages"  # the field the prompt came in, for errors
    echo_texts: tuple[str, ...] | None = None  # completions with echo: each prompt's text


class Overloaded(Exception):
    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class RequestIntake:
    """Plans of chat and completion requests; ProtocolError for a client's mistake, Overloaded
    when the engine admits no more."""

    def __init__(self, config: GatewayConfig, engine: EngineClient, tokenizer: Tokenizer) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.prompt_tokens = config.prompt_tokens or prompt_tokens_for(tokenizer)
        self._work_limiter: anyio.CapacityLimiter | None = None  # made on the event loop, at first use

    async def chat_plan(self, request: Request) -> RequestPlan:
        raw = await self._read_body(request)
        parsed, prompt = await self._off_loop(len(raw), self._prepare_chat, raw)
        model = self._check_model(parsed.options.model)
        self._admit(len(raw))
        prompt_ids = await self._tokenize([prompt], parsed.add_special_tokens, param="messages")
        return RequestPlan("chat", f"chatcmpl-{uuid.uuid4().hex}", model, parsed.options, prompt_ids,
                           parsed.num_logprobs, parsed.thinking, parsed.tools is not None)

    async def completion_plan(self, request: Request) -> RequestPlan:
        raw = await self._read_body(request)
        parsed = await self._off_loop(len(raw), self._prepare_completion, raw)
        model = self._check_model(parsed.options.model)
        self._admit(len(raw))
        texts = [p for p in parsed.prompts if isinstance(p, str)]
        text_ids = iter(await self._tokenize(texts, parsed.add_special_tokens, param="prompt"))
        prompt_ids = [next(text_ids) if isinstance(p, str) else self._check_ids(p) for p in parsed.prompts]
        echo_texts = None
        if parsed.echo:
            echo_texts = tuple(p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=True)
                               for p in parsed.prompts)
        return RequestPlan("completions", f"cmpl-{uuid.uuid4().hex}", model, parsed.options, prompt_ids,
                           parsed.num_logprobs, prompt_param="prompt", echo_texts=echo_texts)

    def max_tokens(self, num_prompt_tokens: int, options: CommonOptions, prompt_param: str) -> int:
        """The tokens one sequence may generate: the request's max_tokens if the context holds it,
        else the room left (capped by default_max_tokens); ProtocolError where none is left."""
        limit = self.config.max_model_len
        if num_prompt_tokens >= limit:
            raise ProtocolError(f"the prompt has {num_prompt_tokens} tokens; this model's context is {limit} tokens",
                                param=prompt_param, code="context_length_exceeded")
        room = limit - num_prompt_tokens
        requested = options.max_tokens
        if requested is None:
            return min(room, self.config.default_max_tokens or room)
        if requested > room:
            raise ProtocolError(f"{options.max_tokens_param} {requested} + prompt {num_prompt_tokens} tokens exceeds "
                                f"the context of {limit} tokens", param=options.max_tokens_param,
                                code="context_length_exceeded")
        return requested

    def _prepare_chat(self, raw: bytes) -> tuple[ChatRequest, str]:
        """Bytes -> parsed request and the encoded prompt text (pure: runs in a worker thread
        for large bodies)."""
        body = decode_body(raw, max_depth=self.config.max_json_depth)
        parsed = parse_chat_request(body, max_num_choices=self.config.max_num_choices,
                                    default_temperature=self.config.default_temperature,
                                    default_thinking=self.config.default_thinking,
                                    vocab_size=self.vocab_size)
        try:
            prompt = encode_messages(parsed.messages, tools=parsed.tools, thinking=parsed.thinking,
                                     reasoning_effort=parsed.reasoning_effort)
        except ChatEncodingError as error:
            raise ProtocolError(str(error), param="messages") from None
        return parsed, prompt

    def _prepare_completion(self, raw: bytes) -> CompletionRequest:
        body = decode_body(raw, max_depth=self.config.max_json_depth)
        return parse_completion_request(body, max_num_choices=self.config.max_num_choices,
                                        default_temperature=self.config.default_temperature,
                                        max_num_prompts=self.config.max_num_prompts,
                                        vocab_size=self.vocab_size)

    async def _off_loop(self, num_bytes: int, work, *args):
        """`work(*args)` inline for a small body, else in a worker thread (bounded in number), so
        parsing and encoding a large body does not stall the event loop."""
        if num_bytes <= self.config.num_bytes_parsed_inline:
            return work(*args)
        return await anyio.to_thread.run_sync(work, *args, limiter=self._limiter())

    async def _read_body(self, request: Request) -> bytes:
        """The size limit holds before any byte is read when Content-Length is given, and while
        reading otherwise."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ProtocolError(f"request body of {declared} bytes exceeds the limit of {limit} bytes", status=413,
                                code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProtocolError(f"request body exceeds the limit of {limit} bytes", status=413,
                                    code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _limiter(self) -> anyio.CapacityLimiter:
        if self._work_limiter is None:
            self._work_limiter = anyio.CapacityLimiter(self.config.max_concurrent_tokenizations)
        return self._work_limiter

    def _check_model(self, model: str | None) -> str:
        if not self.config.serves(model):
            raise ProtocolError(f"The model '{model}' does not exist", param="model", status=404,
                                code="model_not_found")
        return model or self.config.model_name

    def _admit(self, num_body_bytes: int) -> None:
        # Before tokenizing: about 4 bytes of JSON per token is a cheap, generous estimate.
        rejection = self.engine.admission_check(max(1, num_body_bytes // 4))
        if rejection is not None:
            raise Overloaded(rejection.reason, rejection.retry_after_s)

    async def _tokenize(self, texts: list[str], add_special_tokens: bool, *, param: str) -> list[list[int]]:
        """Token ids of text prompts; each is refused from its byte count first when that
        already shows it cannot fit the context (prompt_tokens.py says when that bound holds).
        Long texts are tokenized in a worker thread."""
        limit = self.config.max_model_len
        for text in texts:
            at_least = self.prompt_tokens.min_num_tokens(text, add_special_tokens)
            if at_least is not None and at_least >= limit:
                raise ProtocolError(f"the prompt has at least {at_least} tokens; this model's context is {limit} "
                                    f"tokens", param=param, code="context_length_exceeded")
        if not texts:
            return []
        if sum(len(text) for text in texts) <= self.config.num_chars_tokenized_inline:
            return self.prompt_tokens.encode(self.tokenizer, texts, add_special_tokens)
        return await anyio.to_thread.run_sync(self.prompt_tokens.encode, self.tokenizer, texts, add_special_tokens,
                                              limiter=self._limiter())

    def _check_ids(self, ids: list[int]) -> list[int]:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ProtocolError(f"token ids must be in [0, {self.vocab_size})", param="prompt")
        return list(ids)
