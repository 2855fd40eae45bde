"""X-Request-Id: one id per HTTP request, in every log event of it and on its response.

    incoming `X-Request-Id`: 1..MAX_REQUEST_ID_CHARS printable ASCII characters (spaces
        inside allowed, surrounding ones stripped) -> kept; absent or anything else (too long,
        control or non-ASCII bytes, empty) -> a fresh uuid4 hex (a refused header is logged)
    -> bound as `request_id` to every structlog event logged while the request runs (this
       task and the tasks it starts: structlog's context variables); the engine reads it when
       a sequence is submitted and carries it to the attention worker with the sequence
    -> `X-Request-Id` on the response, whatever its status, streaming included
    -> one event when the request ends, `router.request_finished`: method, path, status,
       duration_s and the outcome: completed (below 400, body sent in full), refused (4xx),
       failed (5xx), aborted (the client went away: 499, or a response cut before its end).
       Info level, except the probes polled all the time (/health, /metrics, /status.json):
       debug.

Pure ASGI (no body buffering, so streams pass through untouched). Registered outermost by
`install_request_ids`, so even a 401 from the API key check carries and logs the id.
"""

from __future__ import annotations

import time
import uuid

import structlog
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = structlog.get_logger("router")

HEADER = b"x-request-id"
MAX_REQUEST_ID_CHARS = 128
QUIET_PATHS = frozenset({"/health", "/metrics", "/status.json"})


def accepted_request_id(raw: bytes | None) -> str | None:
    """The client's id when it is printable ASCII of a bounded length, else None."""
    if raw is None:
        return None
    text = raw.strip(b" \t")
    if not 1 <= len(text) <= MAX_REQUEST_ID_CHARS or not all(0x20 <= byte <= 0x7E for byte in text):
        return None
    return text.decode("ascii")


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((value for key, value in scope.get("headers", ()) if key.lower() == HEADER), None)
        request_id = accepted_request_id(raw)
        if request_id is None:
            request_id = new_request_id()
            if raw is not None:
                log.info("router.request_id_refused", request_id=request_id, length=len(raw),
                         reason="not 1..%d printable ASCII characters" % MAX_REQUEST_ID_CHARS)
        scope.setdefault("state", {})["request_id"] = request_id
        started_s = time.monotonic()
        response = {"status": None, "ended": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                headers = [(key, value) for key, value in message.get("headers", ()) if key.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode("ascii"))]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                response["ended"] = True
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                self._finished(scope, response["status"], response["ended"], time.monotonic() - started_s)

    @staticmethod
    def _finished(scope: Scope, status: int | None, ended: bool, duration_s: float) -> None:
        if status is None:
            outcome = "aborted" if not ended else "failed"  # no response started: cancelled or crashed
        elif status == 499 or not ended:
            outcome = "aborted"
        elif status >= 500:
            outcome = "failed"
        elif status >= 400:
            outcome = "refused"
        else:
            outcome = "completed"
        path = scope.get("path", "")
        emit = log.debug if path in QUIET_PATHS and outcome == "completed" else log.info
        emit("router.request_finished", method=scope.get("method"), path=path, status=status, outcome=outcome,
             duration_s=round(duration_s, 4))


def install_request_ids(app: Starlette) -> None:
    """Wrap `app` in RequestIdMiddleware, outside every other middleware added so far or later
    by `install_bearer_auth` (which places itself inside it)."""
    app.add_middleware(RequestIdMiddleware)
