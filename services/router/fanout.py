"""Runs the sequences of one HTTP request (n choices x prompts) and merges their deltas.

Each sequence is pumped by its own task into one queue, so choices stream in the order
their tokens arrive. Every exit path ends every engine sequence: a stop string or the
deadline aborts it, `cut()` (the server stopping) ends it with an error, `close()` (client
gone, handler done) aborts whatever is unfinished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anyio
import structlog

from moemesh.services.router.engine_client import EngineClient, EngineError, FinishReason, GenerationRequest, TokenEvent
from moemesh.services.router.metrics import RouterMetrics
from moemesh.services.router.sequence_output import ChoiceDelta, SequenceOutput

log = structlog.get_logger("router")


class ChoiceFanOut:
    def __init__(self, engine: EngineClient, requests: list[GenerationRequest], outputs: list[SequenceOutput],
                 metrics: RouterMetrics, *, arrival_monotonic_s: float, deadline_monotonic_s: float | None) -> None:
        self._engine = engine
        self._requests = requests
        self._outputs = outputs
        self._metrics = metrics
        self._arrival_s = arrival_monotonic_s
        self._deadline_s = deadline_monotonic_s
        self._queue: asyncio.Queue[ChoiceDelta] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._streams: list[AsyncIterator[TokenEvent]] = []
        self._cut_message: str | None = None
        self._woken = asyncio.Event()

    @property
    def outputs(self) -> list[SequenceOutput]:
        return self._outputs

    async def start(self) -> None:
        """Submit every sequence; if one submission fails, abort the others and re-raise."""
        try:
            for request in self._requests:
                self._streams.append(await self._engine.submit(request))
        except BaseException:
            await self.close()
            raise
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]

    async def deltas(self, *, tick_s: float | None) -> AsyncIterator[ChoiceDelta | None]:
        """Deltas as they come; None every `tick_s` seconds of silence (for keep-alives).

        Ends after one finishing delta per sequence was handed out (the pumps may have
        finished long before: what counts is what the consumer has seen).
        """
        num_unfinished = len(self._outputs)
        while num_unfinished:
            if self._cut_message is not None:
                for delta in await self._end_all(FinishReason.ERROR, self._cut_message):
                    yield delta
                return
            timeout = tick_s
            if self._deadline_s is not None:
                remaining = self._deadline_s - time.monotonic()
                if remaining <= 0:
                    log.info("router.deadline_exceeded", request_ids=[r.request_id for r in self._requests])
                    for delta in await self._end_all(FinishReason.ABORT, "deadline exceeded"):
                        yield delta
                    return
                timeout = remaining if timeout is None else min(timeout, remaining)
            delta = await self._next_delta(timeout)
            if delta is None:
                if tick_s is not None and self._cut_message is None:
                    yield None
                continue
            if delta.finish_reason is not None:
                num_unfinished -= 1
            yield delta

    async def _next_delta(self, timeout_s: float | None) -> ChoiceDelta | None:
        """The next queued delta, or None after `timeout_s` or when `cut()` wakes the consumer."""
        if not self._queue.empty():
            return self._queue.get_nowait()
        getter = asyncio.ensure_future(self._queue.get())
        woken = asyncio.ensure_future(self._woken.wait())
        try:
            await asyncio.wait((getter, woken), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        return None

    def cut(self, message: str) -> None:
        """End every unfinished sequence with an error (`message`) at the consumer's next step."""
        self._cut_message = message
        self._woken.set()

    async def run_to_end(self) -> list[SequenceOutput]:
        async for _ in self.deltas(tick_s=None):
            pass
        return self._outputs

    async def close(self) -> None:
        """Cancel the pumps and abort every unfinished sequence; safe to call twice."""
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                try:
                    await task
                except BaseException:  # noqa: BLE001 - the pump's own failure was already reported
                    pass
            for request, output in zip(self._requests, self._outputs):
                if not output.finished:
                    await self._abort(request.request_id)
            for stream in self._streams:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()

    async def _abort(self, request_id: str) -> None:
        try:
            await self._engine.abort(request_id)
        except Exception as error:  # noqa: BLE001 - abort must not mask the original outcome
            log.warning("router.abort_failed", request_id=request_id, error=str(error))

    async def _end_all(self, reason: FinishReason, message: str) -> list[ChoiceDelta]:
        """Close (aborting the engine sequences), then what was queued and a final delta for
        every sequence still unfinished."""
        await self.close()
        deltas = []
        while not self._queue.empty():
            deltas.append(self._queue.get_nowait())
        deltas += [o.fail(reason, message) for o in self._outputs if not o.finished]
        return deltas

    async def _pump(self, index: int, stream: AsyncIterator[TokenEvent]) -> None:
        output = self._outputs[index]
        request_id = self._requests[index].request_id
        last_token_s: float | None = None
        try:
            async for event in stream:
                if event.new_token_ids:
                    now = time.monotonic()
                    if last_token_s is None:
                        self._metrics.time_to_first_token.observe(now - self._arrival_s)
                    else:
                        gap_per_token = (now - last_token_s) / len(event.new_token_ids)
                        for _ in event.new_token_ids:
                            self._metrics.inter_token_latency.observe(gap_per_token)
                    last_token_s = now
                    self._metrics.generation_tokens.inc(len(event.new_token_ids))
                delta = output.apply(event)
                if output.stop_matched:
                    await self._abort(request_id)
                self._queue.put_nowait(delta)
                if output.finished:
                    break
            if not output.finished:
                self._queue.put_nowait(output.fail(FinishReason.ABORT, "the engine ended the sequence"))
        except EngineError as error:
            log.warning("router.engine_error", request_id=request_id, error=str(error))
            self._queue.put_nowait(output.fail(FinishReason.ERROR, str(error)))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - one broken sequence must not hang the request
            log.exception("router.pump_failed", request_id=request_id)
            self._queue.put_nowait(output.fail(FinishReason.ERROR, f"internal error: {error}"))
