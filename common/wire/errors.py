"""Errors of the wire layer. Plain exceptions, importable without torch or zmq."""

from __future__ import annotations


class WireError(Exception):
    """A message that cannot be accepted: malformed, unknown, wrong version, or too large.

    Receiving loops log `wire.dropped` and go on; they never crash on one.
    """


class ReplyTimeout(Exception):
    """No reply to a request arrived within its bound. The peer may be dead or slow;
    a reply that arrives later is dropped (and logged as `wire.late_reply`)."""

    def __init__(self, endpoint: str, message_type: str, timeout_s: float) -> None:
        super().__init__(f"no reply from {endpoint} to {message_type} within {timeout_s:.3f}s")
        self.endpoint = endpoint
        self.message_type = message_type
        self.timeout_s = timeout_s


class StagingExhausted(Exception):
    """Every staging buffer is still owned by an unfinished send after the wait bound."""
