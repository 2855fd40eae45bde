"""The generation endpoints: validate -> admit -> encode + tokenize -> fan out -> answer.

`Gateway.chat_completions` and `Gateway.completions` are step 1 of the hot path
(docs/design.md §2): validate the body, refuse overload before tokenizing, tokenize, hand
`GenerationRequest`s to the engine and stream or collect what comes back.

Reading, parsing, admitting and tokenizing the body (and refusing hostile input cheaply):
request_intake.py.

Stopping (`begin_drain`, `cut_open_requests`): new requests get 503 with Retry-After while
open ones finish; what is still open at the drain timeout ends with an error (a final error
chunk and `[DONE]` for streams).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import AsyncIterator

import anyio
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from tokenizers import Tokenizer

from moemesh.common.chat import ChatOutputParser
from moemesh.common.chat import tokens as chat_tokens
from moemesh.services.router import responses
from moemesh.services.router.detokenizer import IncrementalDetokenizer, TokenBytes
from moemesh.services.router.engine_client import EngineClient, EngineError, GenerationRequest
from moemesh.services.router.fanout import ChoiceFanOut
from moemesh.services.router.gateway_config import GatewayConfig
from moemesh.services.router.guided_decoding import GrammarTokenizer
from moemesh.services.router.metrics import RouterMetrics
from moemesh.services.router.protocol import ProtocolError
from moemesh.services.router.request_intake import Overloaded, RequestIntake, RequestPlan
from moemesh.services.router.sequence_output import ChoiceDelta, SequenceOutput
from moemesh.services.router.streaming import DONE, KEEP_ALIVE, ClientDisconnected, SSEResponse, run_until_disconnect, sse_data

log = structlog.get_logger("router")


def error_response(error: ProtocolError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def derive_seed(seed: int | None, choice_index: int) -> int | None:
    """Choice 0 keeps the client's seed (n=1 behaves as asked); others get distinct seeds."""
    if seed is None or choice_index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{choice_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Gateway:
    def __init__(self, config: GatewayConfig, engine: EngineClient, tokenizer: Tokenizer, metrics: RouterMetrics) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.intake = RequestIntake(config, engine, tokenizer)
        self.token_bytes = TokenBytes(tokenizer)
        # sequence delimiters: past an ignored EOS the model starts a new text with BOS; chat
        # (which keeps special tokens for its parser) shows neither (see _fan_out)
        bos_id = tokenizer.token_to_id(chat_tokens.BOS)
        self.grammar_tokenizer = GrammarTokenizer(tokenizer, config.eos_token_ids)
        self.think_end_token_id = tokenizer.token_to_id(chat_tokens.THINK_END)
        self.delimiter_token_ids = frozenset((*config.eos_token_ids, *(() if bos_id is None else (bos_id,))))
        self.draining = False
        self._open_fanouts: set[ChoiceFanOut] = set()
        self._all_closed = asyncio.Event()
        self._all_closed.set()

    # --- endpoints ---------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve("chat", request, self.intake.chat_plan)

    async def completions(self, request: Request) -> Response:
        return await self._serve("completions", request, self.intake.completion_plan)

    async def _serve(self, endpoint: str, request: Request, plan_of) -> Response:
        """The request planned by `plan_of` (request_intake.py) and generated; 503 while
        draining, 429 when overloaded, 4xx for a client's mistake."""
        arrival_s = time.monotonic()
        if self.draining:
            return self._draining_response(endpoint)
        try:
            plan = await plan_of(request)
        except Overloaded as overload:
            return self._overloaded(endpoint, overload)
        except ProtocolError as error:
            return self._client_error(endpoint, error)
        return await self._generate(request, plan, arrival_s)

    # --- refusals ----------------------------------------------------------------------
    def _client_error(self, endpoint: str, error: ProtocolError) -> Response:
        outcome = "not_found" if error.status == 404 else "bad_request"
        self.metrics.requests.labels(endpoint, outcome).inc()
        log.info("router.request_refused", endpoint=endpoint, status=error.status, error=error.message)
        return error_response(error)

    def _draining_response(self, endpoint: str) -> Response:
        self.metrics.requests.labels(endpoint, "rejected").inc()
        error = ProtocolError("the server is shutting down; retry on another replica or later", status=503,
                              error_type="service_unavailable_error", code="shutting_down")
        return error_response(error, headers={"Retry-After": str(self.config.retry_after_draining_s)})

    def _overloaded(self, endpoint: str, overload: Overloaded) -> Response:
        self.metrics.requests.labels(endpoint, "rejected").inc()
        error = ProtocolError(f"server overloaded: {overload}", status=429, error_type="rate_limit_error",
                              code="overloaded")
        return error_response(error, headers={"Retry-After": str(max(1, math.ceil(overload.retry_after_s)))})

    # --- stopping ----------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Refuse new generation requests (503); open ones go on."""
        self.draining = True

    @property
    def num_open_requests(self) -> int:
        return len(self._open_fanouts)

    async def wait_closed(self, timeout_s: float) -> bool:
        """Whether every open request ended within `timeout_s`."""
        with anyio.move_on_after(timeout_s):
            await self._all_closed.wait()
        return self._all_closed.is_set()

    def cut_open_requests(self, message: str) -> None:
        """End every open request with an error: streams send a final error chunk and [DONE]."""
        for fanout in list(self._open_fanouts):
            fanout.cut(message)

    def _track(self, fanout: ChoiceFanOut) -> None:
        self._open_fanouts.add(fanout)
        self._all_closed.clear()

    def _untrack(self, fanout: ChoiceFanOut) -> None:
        self._open_fanouts.discard(fanout)
        if not self._open_fanouts:
            self._all_closed.set()

    # --- generation --------------------------------------------------------------------
    def _fan_out(self, plan: RequestPlan, arrival_s: float) -> ChoiceFanOut:
        options = plan.options
        requests, outputs = [], []
        for prompt_index, prompt_ids in enumerate(plan.prompt_ids):
            max_tokens = self.intake.max_tokens(len(prompt_ids), options, plan.prompt_param)
            for choice in range(options.num_choices):
                index = prompt_index * options.num_choices + choice
                # EOS ends a request in the scheduler unless ignore_eos; as a stop id it would end
                # it regardless (stop ids are checked first), so it is one only without ignore_eos
                ignore_eos = bool(options.sampling_fields.get("ignore_eos"))
                params = options.sampling_params(max_tokens=max_tokens, num_logprobs=plan.num_logprobs,
                                                 seed=derive_seed(options.seed, index),
                                                 stop_token_ids=() if ignore_eos else self.config.eos_token_ids)
                deadline = time.time() + self.config.request_timeout_s if self.config.request_timeout_s else None
                # a thinking chat answer is constrained after its reasoning, from the token ending it
                guide = None if options.response_format is None else self.grammar_tokenizer.new_guide(
                    options.response_format, self.think_end_token_id if plan.thinking else None)
                requests.append(GenerationRequest(f"{plan.response_id}-{index}", tuple(prompt_ids), params, deadline,
                                                  guide))
                parser = None
                if plan.endpoint == "chat":
                    parser = ChatOutputParser(plan.thinking, tools_enabled=plan.tools_enabled,
                                              tool_call_id_prefix=f"call_{plan.response_id[-12:]}_{index}_")
                detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=plan.endpoint != "chat",
                                                     token_bytes=self.token_bytes)
                # chat keeps special tokens for its parser, which ends the message at EOS: past an
                # ignored EOS the text goes on, without showing EOS / BOS themselves
                hidden = self.delimiter_token_ids if ignore_eos and parser is not None else frozenset()
                outputs.append(SequenceOutput(index, detokenizer=detokenizer, token_bytes=self.token_bytes,
                                              stop_strings=options.stop_strings, chat_parser=parser,
                                              hidden_token_ids=hidden))
        deadline_s = arrival_s + self.config.request_timeout_s if self.config.request_timeout_s else None
        return ChoiceFanOut(self.engine, requests, outputs, self.metrics, arrival_monotonic_s=arrival_s,
                            deadline_monotonic_s=deadline_s)

    async def _generate(self, request: Request, plan: RequestPlan, arrival_s: float) -> Response:
        try:
            fanout = self._fan_out(plan, arrival_s)
        except ProtocolError as error:
            return self._client_error(plan.endpoint, error)
        if self.draining:  # the drain began while this request was being tokenized
            return self._draining_response(plan.endpoint)
        self.metrics.prompt_tokens.inc(sum(len(p) for p in plan.prompt_ids))
        self._track(fanout)
        try:
            await fanout.start()
        except EngineError as error:
            self._untrack(fanout)
            self.metrics.requests.labels(plan.endpoint, "engine_error").inc()
            retry_after = getattr(error, "retry_after_s", None)
            return error_response(ProtocolError(f"engine unavailable: {error}", status=503,
                                                error_type="service_unavailable_error"),
                                  headers=None if retry_after is None else {"Retry-After": str(max(1, math.ceil(retry_after)))})
        if plan.options.stream:
            return SSEResponse(self._stream(plan, fanout), finalize=lambda: self._release(fanout))
        try:
            outputs = await run_until_disconnect(request, fanout.run_to_end())
        except ClientDisconnected:
            self.metrics.requests.labels(plan.endpoint, "client_disconnected").inc()
            return Response(status_code=499)
        finally:
            await self._release(fanout)
        return self._complete(plan, outputs)

    async def _release(self, fanout: ChoiceFanOut) -> None:
        """Abort what is unfinished and stop counting the request as open (safe twice)."""
        await fanout.close()
        self._untrack(fanout)

    def _usage(self, plan: RequestPlan, outputs: list[SequenceOutput]) -> responses.UsageTotals:
        usage = responses.combine_usage(outputs, [len(p) for p in plan.prompt_ids], plan.options.num_choices)
        self.metrics.cached_prompt_tokens.inc(usage.num_cached_tokens)
        if usage.speculative is not None:
            self.metrics.spec_draft_tokens.inc(usage.speculative.num_draft_tokens)
            self.metrics.spec_accepted_tokens.inc(usage.speculative.num_accepted_tokens)
        return usage

    def _outcome(self, outputs: list[SequenceOutput]) -> str:
        reasons = {o.finish_reason for o in outputs}
        return "engine_error" if "error" in reasons else "timeout" if "abort" in reasons else "ok"

    def _complete(self, plan: RequestPlan, outputs: list[SequenceOutput]) -> Response:
        outcome = self._outcome(outputs)
        self.metrics.requests.labels(plan.endpoint, outcome).inc()
        if outcome == "engine_error":
            message = next(o for o in outputs if o.finish_reason == "error")
            log.warning("router.request_failed", response_id=plan.response_id, error=message.error_message)
            return error_response(ProtocolError(f"engine error: {message.error_message or 'generation failed'}",
                                                status=503, error_type="service_unavailable_error"),
                                  headers={"Retry-After": str(self.config.retry_after_draining_s)} if self.draining
                                  else None)
        if outcome == "timeout":
            return error_response(ProtocolError("request deadline exceeded", status=504, error_type="timeout_error"))
        usage = self._usage(plan, outputs)
        created = int(time.time())
        with_logprobs = plan.num_logprobs is not None
        if plan.endpoint == "chat":
            return JSONResponse(responses.chat_completion(plan.response_id, created, plan.model, outputs, usage,
                                                          with_logprobs))
        return JSONResponse(responses.completion(plan.response_id, created, plan.model, outputs, usage, with_logprobs,
                                                 echo_texts=self._echo_per_choice(plan)))

    @staticmethod
    def _echo_per_choice(plan: RequestPlan) -> list[str] | None:
        if plan.echo_texts is None:
            return None
        return [text for text in plan.echo_texts for _ in range(plan.options.num_choices)]

    async def _stream(self, plan: RequestPlan, fanout: ChoiceFanOut) -> AsyncIterator[bytes]:
        created = int(time.time())
        chat = plan.endpoint == "chat"
        with_logprobs = plan.num_logprobs is not None
        started: set[int] = set()
        text_offsets: dict[int, int] = {}
        outcome = "client_disconnected"
        error_message: str | None = None
        try:
            for index, text in enumerate(self._echo_per_choice(plan) or ()):
                text_offsets[index] = len(text)
                yield sse_data(responses.completion_chunk(plan.response_id, created, plan.model,
                                                          ChoiceDelta(index, text=text), with_logprobs=False,
                                                          text_offset=0))
            async for delta in fanout.deltas(tick_s=self.config.keep_alive_interval_s):
                if delta is None:
                    yield KEEP_ALIVE
                    continue
                first = delta.index not in started
                if not (delta.has_payload() or delta.finish_reason or (chat and first)):
                    continue
                started.add(delta.index)
                if chat:
                    chunk = responses.chat_chunk(plan.response_id, created, plan.model, delta, first=first,
                                                 with_logprobs=with_logprobs)
                else:
                    offset = text_offsets.get(delta.index, 0)
                    text_offsets[delta.index] = offset + len(delta.text)
                    chunk = responses.completion_chunk(plan.response_id, created, plan.model, delta,
                                                       with_logprobs=with_logprobs, text_offset=offset)
                yield sse_data(chunk)
                if delta.finish_reason == "error":
                    error_message = error_message or delta.error_message or "generation failed"
            usage = self._usage(plan, fanout.outputs)
            if plan.options.include_usage:
                yield sse_data(responses.usage_chunk(plan.response_id, created, plan.model, usage, chat=chat))
            if error_message is not None:  # after the choices' final chunks: what ended them
                yield sse_data(responses.stream_error(error_message))
            yield DONE
            outcome = self._outcome(fanout.outputs)
        finally:
            self.metrics.requests.labels(plan.endpoint, outcome).inc()
            await self._release(fanout)
