"""Request/reply over ZeroMQ with explicit ids and explicit timeouts (DEALER -> ROUTER).

On the socket a message is `[envelope, header, *frames]` (the ROUTER side sees the peer
identity first). The envelope is 9 bytes, `!BQ`: kind (REQUEST, REPLY, NOTIFY) and the
correlation id the client chose; a reply carries the id of its request. ZeroMQ does not
tell a sender that its peer died, so every request has a deadline: `ReplyTimeout` when it
passes, and a reply arriving later is dropped and logged as `wire.late_reply`.

Clients: `AsyncClient` (zmq.asyncio; many requests in flight, one reader task resolves them)
and `SyncClient` (blocking, one request at a time; the attention worker's hot path).
Server: `AsyncServer`, whose `recv()` drops malformed messages (`wire.dropped`) and answers
them with ErrorReply(MALFORMED) when their envelope is readable, so a sender fails fast.

Endpoints are `ipc://path` or `tcp://host:port`. Security (common/security): servers and
clients take `security=` (a `SocketSecurity`): with keys it makes every socket CURVE
(authenticated, encrypted); without it binding tcp beyond loopback is refused unless the
deployment is explicitly insecure (docs/design.md §3). The default (None) is plain sockets
and the same bind refusal.

Sends are zero-copy. With `staging=` (a SendStagingPool) the message's tensors are first copied
into a leased buffer and sent as a `TrackedMessage` (common/wire/tracked_send.py), whose one
tracker covers every frame of the buffer; without it the frames view the message's own
tensors, which the caller must not write until the peer has them.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import structlog
import zmq
import zmq.asyncio

from moemesh.common.security import bind_policy
from moemesh.common.wire import codec
from moemesh.common.wire.errors import ReplyTimeout, WireError
from moemesh.common.wire.messages import ErrorCode, ErrorReply
from moemesh.common.wire.schema import DEFAULT_LIMITS, WireLimits
from moemesh.common.wire.tracked_send import TrackedMessage

if TYPE_CHECKING:
    from moemesh.common.security.socket_security import SocketSecurity

log = structlog.get_logger("wire")

_ENVELOPE = struct.Struct("!BQ")


class Kind(IntEnum):
    REQUEST = 1
    REPLY = 2
    NOTIFY = 3  # one-way: no reply is sent (Ready, Heartbeat)


def pack_envelope(kind: Kind, correlation_id: int) -> bytes:
    return _ENVELOPE.pack(kind, correlation_id)


def unpack_envelope(frame: Any) -> tuple[Kind, int]:
    raw = frame.bytes if hasattr(frame, "bytes") else bytes(frame)
    if len(raw) != _ENVELOPE.size:
        raise WireError(f"envelope of {len(raw)} bytes, expected {_ENVELOPE.size}")
    kind_value, correlation_id = _ENVELOPE.unpack(raw)
    try:
        return Kind(kind_value), correlation_id
    except ValueError:
        raise WireError(f"unknown envelope kind {kind_value}") from None


def check_bind_endpoint(endpoint: str, security: SocketSecurity | None = None) -> None:
    """Refuse endpoints a server may not bind: unknown schemes, and tcp beyond loopback
    unless `security` makes the socket CURVE (or says insecure). Raises a ValueError."""
    if security is None:
        bind_policy.check_bind_endpoint(endpoint)
    else:
        security.check_bind(endpoint)


def _new_socket(context: zmq.Context, socket_type: int) -> zmq.Socket:
    socket = context.socket(socket_type)
    socket.setsockopt(zmq.LINGER, 0)  # closing never blocks on undelivered messages
    return socket


def _secure_or_close(socket: zmq.Socket, secure: Any, endpoint: str) -> None:
    """Apply security options; a socket that cannot be secured is closed, not leaked
    (an open socket would block context.term())."""
    try:
        secure(socket, endpoint)
    except BaseException:
        socket.close(linger=0)
        raise


def _outgoing(prefix: list[bytes], message: Any, limits: WireLimits, staging: Any) -> list | TrackedMessage:
    """The parts to send. Without a staging pool: a plain list whose tensor frames view the
    message's own tensors (zero-copy; the caller keeps them unchanged). With one: a
    TrackedMessage over a leased buffer, whose lease returns once every frame was released."""
    if staging is None:
        return [*prefix, *codec.encode(message, limits=limits)]
    return staging.stage(lambda tensor_writer: codec.encode(message, limits=limits, tensor_writer=tensor_writer),
                         tuple(prefix))


async def _send_async(socket: zmq.asyncio.Socket, outgoing: list | TrackedMessage) -> None:
    if isinstance(outgoing, TrackedMessage):
        await outgoing.send_async(socket)
    else:
        await socket.send_multipart(outgoing, copy=False)


@dataclass(frozen=True)
class Incoming:
    """One received message and where it came from; `reply` needs `peer` and the id."""

    peer: bytes
    kind: Kind
    correlation_id: int
    message: Any

    @property
    def expects_reply(self) -> bool:
        return self.kind is Kind.REQUEST


class AsyncServer:
    """A bound ROUTER socket. Sends are zero-copy: tensors in a reply must not be written
    afterwards unless a staging pool (copy into recycled buffers) is passed to `reply`."""

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.asyncio.Context,
        limits: WireLimits = DEFAULT_LIMITS,
        accept: Iterable[type] | None = None,
        security: SocketSecurity | None = None,
    ) -> None:
        check_bind_endpoint(endpoint, security)
        self.limits = limits
        self.accept = frozenset(accept) if accept is not None else None
        self.socket = _new_socket(context, zmq.ROUTER)
        if security is not None:
            _secure_or_close(self.socket, security.secure_server, endpoint)
        self.socket.bind(endpoint)
        # the bound address, with the real port when tcp://host:* asked for any free one
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_dropped = 0

    async def recv(self) -> Incoming:
        """The next valid message. Malformed ones are logged, answered if possible, skipped."""
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            incoming = await self._parse(frames)
            if incoming is not None:
                return incoming

    async def recv_queued(self) -> list[Incoming]:
        """Every valid message already queued, without waiting for more (used by drains)."""
        received = []
        while await self.socket.poll(0, zmq.POLLIN):
            incoming = await self._parse(await self.socket.recv_multipart(copy=False))
            if incoming is not None:
                received.append(incoming)
        return received

    async def _parse(self, frames: list) -> Incoming | None:
        peer = frames[0].bytes
        kind, correlation_id = None, None
        try:
            if len(frames) < 2:
                raise WireError("no envelope")
            kind, correlation_id = unpack_envelope(frames[1])
            if len(frames) < 3:
                raise WireError("no header")
            if kind is Kind.REPLY:
                raise WireError("a server does not accept replies")
            message = codec.decode(frames[2:], limits=self.limits, accept=self.accept)
        except WireError as error:
            self.num_dropped += 1
            log.warning("wire.dropped", endpoint=self.endpoint, reason=str(error)[:200])
            if kind is Kind.REQUEST:
                await self._send(peer, Kind.REPLY, correlation_id,
                                 ErrorReply(code=ErrorCode.MALFORMED, message=str(error)[:200]), None)
            return None
        return Incoming(peer=peer, kind=kind, correlation_id=correlation_id, message=message)

    async def reply(self, incoming: Incoming, message: Any, staging: Any = None) -> None:
        if not incoming.expects_reply:
            raise ValueError("a NOTIFY message has no reply")
        await self._send(incoming.peer, Kind.REPLY, incoming.correlation_id, message, staging)

    async def _send(self, peer: bytes, kind: Kind, correlation_id: int, message: Any, staging: Any) -> None:
        prefix = [peer, pack_envelope(kind, correlation_id)]
        await _send_async(self.socket, _outgoing(prefix, message, self.limits, staging))

    def close(self) -> None:
        self.socket.close(linger=0)


class _DealerClient:
    """A DEALER socket connected to one server (a CURVE client when `security` says so), with the
    reply types it accepts, the request ids it hands out and its count of late replies."""

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.Context,
        limits: WireLimits = DEFAULT_LIMITS,
        accept: Iterable[type] | None = None,
        default_timeout_s: float = 5.0,
        security: SocketSecurity | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.limits = limits
        self.accept = frozenset(accept) if accept is not None else None
        self.default_timeout_s = default_timeout_s
        self.socket = _new_socket(context, zmq.DEALER)
        if security is not None:
            _secure_or_close(self.socket, security.secure_client, endpoint)
        self.socket.connect(endpoint)
        self._ids = itertools.count(1)
        self.num_late_replies = 0

    def _bound_s(self, timeout_s: float | None) -> float:
        return self.default_timeout_s if timeout_s is None else timeout_s

    def _log_dropped(self, error: Exception) -> None:
        log.warning("wire.dropped", endpoint=self.endpoint, reason=str(error)[:200])

    def _count_late_reply(self, correlation_id: int) -> None:
        self.num_late_replies += 1
        log.warning("wire.late_reply", endpoint=self.endpoint, correlation_id=correlation_id)


class AsyncClient(_DealerClient):
    """A DEALER connected to one server (zmq.asyncio context); requests may overlap; replies
    matched by id."""

    def __init__(self, endpoint: str, **options: Any) -> None:  # options: as `_DealerClient`
        super().__init__(endpoint, **options)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def request(self, message: Any, timeout_s: float | None = None, staging: Any = None) -> Any:
        """The reply message (possibly an ErrorReply), or ReplyTimeout after timeout_s."""
        bound_s = self._bound_s(timeout_s)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        correlation_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = future
        try:
            async with asyncio.timeout(bound_s):
                await self._send(Kind.REQUEST, correlation_id, message, staging)
                return await future
        except TimeoutError:
            raise ReplyTimeout(self.endpoint, type(message).TYPE, bound_s) from None
        finally:
            self._pending.pop(correlation_id, None)

    async def notify(self, message: Any, timeout_s: float | None = None) -> None:
        """Send one-way; bounded so that a full queue to a dead peer cannot hang the caller."""
        bound_s = self._bound_s(timeout_s)
        try:
            async with asyncio.timeout(bound_s):
                await self._send(Kind.NOTIFY, next(self._ids), message, None)
        except TimeoutError:
            raise ReplyTimeout(self.endpoint, type(message).TYPE, bound_s) from None

    async def _send(self, kind: Kind, correlation_id: int, message: Any, staging: Any) -> None:
        prefix = [pack_envelope(kind, correlation_id)]
        await _send_async(self.socket, _outgoing(prefix, message, self.limits, staging))

    async def _read_replies(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            try:
                kind, correlation_id = unpack_envelope(frames[0])
            except (WireError, IndexError) as error:
                self._log_dropped(error)
                continue
            future = self._pending.get(correlation_id)
            if future is None or future.done() or kind is not Kind.REPLY:
                self._count_late_reply(correlation_id)
                continue
            try:
                future.set_result(codec.decode(frames[1:], limits=self.limits, accept=self.accept))
            except WireError as error:
                self._log_dropped(error)
                future.set_exception(error)

    async def close(self) -> None:
        """Stop the reply reader and close the socket. A cancellation of the caller itself (a
        loop stopped while it reconnects) passes through; only the reader's own ends here."""
        reader, self._reader = self._reader, None
        try:
            if reader is not None:
                reader.cancel()
                try:
                    await reader
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise
        finally:
            self.socket.close(linger=0)


class SyncClient(_DealerClient):
    """Blocking DEALER client, one request at a time; for loops that must not yield."""

    def request(self, message: Any, timeout_s: float | None = None, staging: Any = None) -> Any:
        bound_s = self._bound_s(timeout_s)
        deadline = time.monotonic() + bound_s
        correlation_id = next(self._ids)
        if not self.socket.poll(int(bound_s * 1000), zmq.POLLOUT):
            raise ReplyTimeout(self.endpoint, type(message).TYPE, bound_s)
        outgoing = _outgoing([pack_envelope(Kind.REQUEST, correlation_id)], message, self.limits, staging)
        if isinstance(outgoing, TrackedMessage):
            outgoing.send(self.socket)
        else:
            self.socket.send_multipart(outgoing, copy=False)
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self.socket.poll(remaining_ms, zmq.POLLIN):
                raise ReplyTimeout(self.endpoint, type(message).TYPE, bound_s)
            reply = self.socket.recv_multipart(copy=False)
            try:
                kind, reply_id = unpack_envelope(reply[0])
            except WireError as error:
                self._log_dropped(error)
                continue
            if reply_id != correlation_id or kind is not Kind.REPLY:
                self._count_late_reply(reply_id)
                continue
            return codec.decode(reply[1:], limits=self.limits, accept=self.accept)

    def close(self) -> None:
        self.socket.close(linger=0)
