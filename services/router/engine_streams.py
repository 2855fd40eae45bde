"""Per-request token streams: the engine loop pushes `TokenEvent`s, the gateway iterates them.

One `RequestStream` per submitted sequence. The engine loop converts each scheduler
`RequestEvent` (plus the worker's logprobs and the request's counters) into one
`TokenEvent` and pushes it at once; the gateway's iterator ends after the event whose
finish_reason is set. Invariant: exactly one finishing event is ever pushed per stream;
anything pushed after it is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from moemesh.common.wire.messages import TokenLogprobs
from moemesh.services.router.engine_client import FinishReason, SpeculativeStats, TokenEvent, TopLogprob, Usage
from moemesh.services.router.scheduler import FinishReason as SchedulerFinishReason
from moemesh.services.router.scheduler import Request, RequestEvent

_FINISH_REASONS = {
    SchedulerFinishReason.STOP: FinishReason.STOP,
    SchedulerFinishReason.LENGTH: FinishReason.LENGTH,
    SchedulerFinishReason.ABORT: FinishReason.ABORT,
    SchedulerFinishReason.DEADLINE: FinishReason.ABORT,  # the gateway reports it as a timeout
    SchedulerFinishReason.ERROR: FinishReason.ERROR,
}


class RequestStream:
    """The queue between the engine loop (producer) and one gateway pump (consumer)."""

    def __init__(self, request: Request, client_request_id: str | None = None) -> None:
        self.request = request
        self.client_request_id = client_request_id  # the HTTP request's X-Request-Id (request_id.py)
        self.finished = False
        self.num_draft_tokens = 0
        self.num_accepted_drafts = 0
        self.num_verify_steps = 0
        self.num_tokens_pushed = 0  # tokens the gateway has been given: none, and a failed step may run it again
        self.recovery_deadline_s: float | None = None  # set when a failure first caught it (engine.py)
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def push(self, event: TokenEvent) -> bool:
        """Queue an event; False (dropped) once the stream has finished."""
        if self.finished:
            return False
        self.finished = event.finished
        self.num_tokens_pushed += len(event.new_token_ids)
        self._queue.put_nowait(event)
        return True

    async def events(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self._queue.get()
            yield event
            if event.finished:
                return

    # -- conversion ----------------------------------------------------------------------
    def usage(self) -> Usage:
        request = self.request
        return Usage(
            num_prompt_tokens=request.num_prompt_tokens,
            num_completion_tokens=request.num_output_tokens,
            num_cached_prompt_tokens=request.num_cached_prefix_tokens,
        )

    def speculative(self) -> SpeculativeStats:
        if not self.num_draft_tokens:
            return SpeculativeStats(ran=False)
        return SpeculativeStats(
            ran=True,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_drafts,
            mean_accepted_length=(self.num_accepted_drafts + self.num_verify_steps) / self.num_verify_steps,
        )

    def token_event(self, event: RequestEvent, logprobs: TokenLogprobs | None) -> TokenEvent:
        """The gateway's view of one scheduler event. Logprobs are cut to the tokens kept
        (a stop inside a multi-token verification drops the tokens after it)."""
        if event.num_draft_tokens:
            self.num_draft_tokens += event.num_draft_tokens
            self.num_accepted_drafts += event.num_accepted_drafts
            self.num_verify_steps += 1
        num_new = len(event.new_token_ids)
        token_logprobs = top_logprobs = None
        if self.request.sampling_params.num_logprobs is not None and logprobs is not None and num_new:
            token_logprobs = tuple(float(value) for value in logprobs.logprobs[:num_new])
            if logprobs.top_token_ids:
                top_logprobs = tuple(
                    tuple(TopLogprob(int(token_id), float(value)) for token_id, value in zip(ids, values))
                    for ids, values in zip(logprobs.top_token_ids[:num_new], logprobs.top_logprobs[:num_new])
                )
        finish_reason = None if event.finish_reason is None else _FINISH_REASONS[event.finish_reason]
        error_message = event.error
        if event.finish_reason is SchedulerFinishReason.DEADLINE:
            error_message = "deadline exceeded"
        return TokenEvent(
            request_id=event.request_id,
            new_token_ids=tuple(event.new_token_ids),
            logprobs=token_logprobs,
            top_logprobs=top_logprobs,
            finish_reason=finish_reason,
            usage=self.usage(),
            speculative=self.speculative() if finish_reason is not None else None,
            error_message=error_message,
        )

    def final_event(self, reason: FinishReason, message: str | None = None) -> TokenEvent:
        """A finishing event with no new tokens (abort, engine shutdown)."""
        return TokenEvent(
            request_id=self.request.request_id,
            new_token_ids=(),
            finish_reason=reason,
            usage=self.usage(),
            speculative=self.speculative(),
            error_message=message,
        )
