"""Data-plane client of the attention worker: one DEALER socket per expert worker.

Unlike `SyncClient.request` (send, then wait), sending and receiving are separate so that a
micro-batch's Dispatches can be in flight while another micro-batch's attention runs. Every
request carries its own correlation id; replies are matched by id (a reply for another
in-flight request is kept until asked for), and every wait has a deadline (ReplyTimeout).

Sends are zero-copy: a tensor given to `send` must stay unchanged until its reply arrived, which
holds here because the sender keeps the message in `_in_flight` until then (the expert worker
replies only after reading the request).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import structlog
import zmq

from common.wire import codec
from common.wire.errors import ReplyTimeout, WireError
from common.wire.messages import Combine, ErrorReply
from common.wire.schema import DEFAULT_LIMITS, WireLimits
from common.wire.transport import Kind, pack_envelope, unpack_envelope

log = structlog.get_logger("attention")


class ExpertChannel:
    def __init__(self, endpoints: Sequence[str], *, context: zmq.Context, timeout_s: float = 30.0,
                 limits: WireLimits = DEFAULT_LIMITS) -> None:
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self.limits = limits
        self.sockets = []
        for endpoint in self.endpoints:
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            self.sockets.append(socket)
        self._ids = itertools.count(1)
        self._in_flight: dict[int, Any] = {}  # correlation id -> the message (keeps tensors alive)
        self._arrived: dict[int, Any] = {}  # correlation id -> reply received before it was asked for
        self.num_requests = 0

    @property
    def num_workers(self) -> int:
        return len(self.sockets)

    def send(self, worker_index: int, message: Any) -> int:
        """Queue one request to worker `worker_index`; returns its correlation id (a ticket)."""
        correlation_id = next(self._ids)
        frames = codec.encode(message, limits=self.limits)
        self.sockets[worker_index].send_multipart([pack_envelope(Kind.REQUEST, correlation_id), *frames], copy=False)
        self._in_flight[correlation_id] = message
        self.num_requests += 1
        return correlation_id

    def receive(self, worker_index: int, correlation_id: int) -> Combine | ErrorReply:
        """The reply to ticket `correlation_id` from worker `worker_index`, waiting up to timeout_s."""
        socket = self.sockets[worker_index]
        deadline = time.monotonic() + self.timeout_s
        try:
            while correlation_id not in self._arrived:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not socket.poll(remaining_ms, zmq.POLLIN):
                    raise ReplyTimeout(self.endpoints[worker_index], "dispatch", self.timeout_s)
                frames = socket.recv_multipart(copy=False)
                try:
                    kind, reply_id = unpack_envelope(frames[0])
                    if kind is not Kind.REPLY or reply_id not in self._in_flight:
                        log.warning("attention.late_reply", endpoint=self.endpoints[worker_index], reply_id=reply_id)
                        continue
                    self._arrived[reply_id] = codec.decode(frames[1:], limits=self.limits,
                                                           accept=(Combine, ErrorReply))
                except WireError as error:
                    log.warning("attention.reply_dropped", endpoint=self.endpoints[worker_index],
                                reason=str(error)[:200])
            return self._arrived.pop(correlation_id)
        finally:
            self._in_flight.pop(correlation_id, None)

    def close(self) -> None:
        for socket in self.sockets:
            socket.close(linger=0)
