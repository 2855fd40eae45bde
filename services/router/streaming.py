"""Server-sent events and client-disconnect detection.

`SSEResponse` sends `data: <json>` events from an async iterator while a second task
listens for `http.disconnect`; when the client goes away the iterator is cancelled, so its
`finally` (which aborts the engine sequences) runs at once rather than at the next write.
`run_until_disconnect` gives the same guarantee to non-streaming handlers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

KEEP_ALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def sse_data(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse:
    """An ASGI response streaming the byte chunks of `events` as text/event-stream."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 finalize: Callable[[], Awaitable[None]] | None = None) -> None:
        """finalize: awaited once the response is over, however it ended (also when `events`
        never started: its own `finally` then never runs)."""
        self._events = events
        self._finalize = finalize
        self._headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                         (b"x-accel-buffering", b"no")]
        self._headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def pump() -> None:
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": self._headers})
                    async for chunk in self._events:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    pass  # client gone while writing
                finally:
                    group.cancel_scope.cancel()

            async def watch() -> None:
                await _wait_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(pump)
            group.start_soon(watch)
        await _close(self._events)
        if self._finalize is not None:
            with anyio.CancelScope(shield=True):
                await self._finalize()


async def _close(events: AsyncIterator[bytes]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    The request body must already have been read (then `receive` only reports disconnects).
    """
    result: list[T] = []
    disconnected = False
    async with anyio.create_task_group() as group:

        async def do_work() -> None:
            result.append(await work)
            group.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal disconnected
            await _wait_for_disconnect(request.receive)
            disconnected = True
            group.cancel_scope.cancel()

        group.start_soon(do_work)
        group.start_soon(watch)
    if disconnected and not result:
        raise ClientDisconnected()
    return result[0]
