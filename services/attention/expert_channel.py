"""Data-plane client of the attention worker: one DEALER socket per expert worker.

Unlike `SyncClient.request` (send, then wait), sending and receiving are separate so that a
micro-batch's Dispatches can be in flight while another micro-batch's attention runs. Every
request carries its own correlation id; replies are matched by id (a reply for another
in-flight request is kept until asked for), and every wait has a deadline (ReplyTimeout).

Sends leave from a fixed pool of staging buffers (`common.wire.staging.SendStagingPool`,
pinned on CUDA hosts so the device->host copy of the activations is a DMA): the message's
tensors are copied into one leased buffer, the frames are views of it, and the buffer is
reused only after ZeroMQ's MessageTracker says libzmq released them. So the caller may reuse
or free its tensors as soon as `send` returns, and the steady state allocates nothing. A
message larger than one buffer (a prefill step beyond the configured size) is sent from its
own tensors instead, kept alive in `_in_flight` until its reply arrived, and counted in
`num_unstaged_sends` (logged once as `attention.dispatch_unstaged`).

A dead expert worker keeps its queued messages (and their staging buffers) until it comes
back; once every buffer is held, `send` raises StagingExhausted after the pool's wait bound,
as the receive side raises ReplyTimeout: the step fails, the worker does not hang.

With CURVE keys in the deployment, each socket is made a CURVE client of its expert worker
(`SocketSecurity.secure_client`) before it connects.

An endpoint `local:<name>` (`local_endpoint`) names the attention worker's own experts
(local_experts.py): it takes a channel index like any worker, so placements and replica tables
address it the same way, but it has no socket and nothing is ever sent to it.

A channel dropped without `close()` closes its sockets when it is collected (a weakref
finalizer, which runs before any garbage Context's __del__): otherwise a worker caught in a
reference cycle would have its Context terminated by the cycle collector while the sockets are
still open, and `Context.term()` would block forever inside the collector.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
import zmq

from moemesh.common.wire import codec
from moemesh.common.wire.errors import ReplyTimeout, WireError
from moemesh.common.wire.messages import (
    Combine, CombineSlot, CudaIpcAttached, Dispatch, DispatchSlot, ErrorReply, MailboxAttached,
)
from moemesh.common.wire.schema import DEFAULT_LIMITS, WireLimits
from moemesh.common.wire.staging import SendStagingPool, StagingConfig, send_staged
from moemesh.common.wire.transport import Kind, pack_envelope, unpack_envelope

if TYPE_CHECKING:
    from moemesh.common.security.socket_security import SocketSecurity

log = structlog.get_logger("attention")

# 16 buffers of 32 MiB: a 2048-token V4-Flash Dispatch (bf16 [T, 4096] + ids, weights, mask) is
# about 17 MB, and buffers come back as soon as libzmq has written them, not when replies arrive.
DEFAULT_DISPATCH_STAGING = StagingConfig(num_buffers=16, buffer_bytes=32 << 20)
_MAX_ALIGN_PAD_BYTES = 64  # staging aligns each tensor to at most this many bytes
LOCAL_SCHEME = "local:"


def local_endpoint(attention_name: str) -> str:
    """The channel endpoint of the experts held by attention worker `attention_name` itself."""
    return f"{LOCAL_SCHEME}{attention_name}"


def is_local_endpoint(endpoint: str) -> bool:
    return endpoint.startswith(LOCAL_SCHEME)


def staged_bytes_upper_bound(message: Any) -> int:
    """Bytes one staging buffer needs for the tensors of `message` (with alignment padding)."""
    total = 0
    for spec in dataclasses.fields(message):
        value = getattr(message, spec.name)
        if hasattr(value, "element_size") and hasattr(value, "numel"):
            total += value.numel() * value.element_size() + _MAX_ALIGN_PAD_BYTES
    return total


class ExpertChannel:
    def __init__(self, endpoints: Sequence[str], *, context: zmq.Context, timeout_s: float = 30.0,
                 limits: WireLimits = DEFAULT_LIMITS, staging: StagingConfig | None = DEFAULT_DISPATCH_STAGING,
                 security: SocketSecurity | None = None, stall_warning_s: float = 1.0) -> None:
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        # a reply slower than this is recorded in `stalls` (endpoint, waited s): a worker that was frozen,
        # or killed and restarted before the timeout, stalls the step without failing it; the step's
        # recovery logs them with its requests
        self.stall_warning_s = stall_warning_s
        self.stalls: list[tuple[str, float]] = []
        self.limits = limits
        self.sockets = []
        try:
            for endpoint in self.endpoints:
                if is_local_endpoint(endpoint):
                    self.sockets.append(None)  # computed in-process by the dispatcher
                    continue
                socket = context.socket(zmq.DEALER)
                self.sockets.append(socket)
                socket.setsockopt(zmq.LINGER, 0)
                if security is not None:
                    security.secure_client(socket, endpoint)
                socket.connect(endpoint)
        except BaseException:
            _close_sockets(self.sockets)  # an open socket would block context.term()
            raise
        self._finalizer = weakref.finalize(self, _close_sockets, self.sockets)
        self.staging = SendStagingPool(staging) if staging is not None else None
        self._ids = itertools.count(1)
        self._in_flight: dict[int, Any] = {}  # correlation id -> message whose own tensors are on the wire, or None
        self._arrived: dict[int, Any] = {}  # correlation id -> reply received before it was asked for
        self.num_requests = 0
        self.num_layer_messages = 0  # Dispatch and DispatchSlot sent: a layer's work over ZeroMQ (step counters)
        self.num_unstaged_sends = 0

    @property
    def num_workers(self) -> int:
        return len(self.sockets)

    def send(self, worker_index: int, message: Any) -> int:
        """Queue one request to worker `worker_index`; returns its correlation id (a ticket).
        The message's tensors may be changed as soon as this returns."""
        correlation_id = next(self._ids)
        envelope = pack_envelope(Kind.REQUEST, correlation_id)
        socket = self.sockets[worker_index]
        keep_alive = None
        if self.staging is not None and staged_bytes_upper_bound(message) <= self.staging.config.buffer_bytes:
            send_staged(socket, self.staging,
                        lambda tensor_writer: codec.encode(message, limits=self.limits, tensor_writer=tensor_writer),
                        prefix=(envelope,))
        else:
            if self.staging is not None:
                if not self.num_unstaged_sends:
                    log.warning("attention.dispatch_unstaged", num_bytes=staged_bytes_upper_bound(message),
                                buffer_bytes=self.staging.config.buffer_bytes)
                self.num_unstaged_sends += 1
            frames = codec.encode(message, limits=self.limits)
            socket.send_multipart([envelope, *frames], copy=False)
            keep_alive = message  # zero-copy from its own tensors: keep them until the reply
        self._in_flight[correlation_id] = keep_alive
        self.num_requests += 1
        if isinstance(message, (Dispatch, DispatchSlot)):
            self.num_layer_messages += 1
        return correlation_id

    def receive(self, worker_index: int, correlation_id: int) -> Combine | ErrorReply:
        """The reply to ticket `correlation_id` from worker `worker_index`, waiting up to timeout_s.
        Tensors in the reply view the received frames (read-only)."""
        socket = self.sockets[worker_index]
        started_s = time.monotonic()
        deadline = started_s + self.timeout_s
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
                                                           accept=(Combine, CombineSlot, CudaIpcAttached, MailboxAttached,
                                                                   ErrorReply))
                except WireError as error:
                    log.warning("attention.reply_dropped", endpoint=self.endpoints[worker_index],
                                reason=str(error)[:200])
            waited_s = time.monotonic() - started_s
            if waited_s >= self.stall_warning_s:
                self.stalls.append((self.endpoints[worker_index], waited_s))
            return self._arrived.pop(correlation_id)
        finally:
            self._in_flight.pop(correlation_id, None)

    def attach_cuda_ipc(self, worker_index: int, ring: Any, timeout_s: float | None = None) -> bool:
        """Offer `ring` (a `common.wire.cuda_ipc.DispatchRing`) to worker `worker_index`; True when it
        mapped the rings (Dispatches to it may then use `DispatchSlot`), False (logged as
        `attention.data_plane_fallback`) when it refused: another host, a CPU worker, a mapping error."""
        saved_timeout_s = self.timeout_s
        self.timeout_s = saved_timeout_s if timeout_s is None else timeout_s
        try:
            reply = self.receive(worker_index, self.send(worker_index, ring.attach_message()))
        finally:
            self.timeout_s = saved_timeout_s
        if isinstance(reply, CudaIpcAttached) and reply.accepted and reply.channel_id == ring.channel_id:
            ring.attached(reply.combine_event_handles, reply.sync)
            log.info("attention.data_plane", endpoint=self.endpoints[worker_index], data_plane="cuda_ipc",
                     num_slots=ring.layout.num_slots, max_tokens=ring.layout.max_tokens, sync=str(ring.sync))
            return True
        reason = reply.reason if isinstance(reply, CudaIpcAttached) else f"{type(reply).__name__}: {reply}"
        log.warning("attention.data_plane_fallback", endpoint=self.endpoints[worker_index], data_plane="zmq",
                    reason=str(reason)[:300])
        return False

    def close(self) -> None:
        self._finalizer()  # idempotent


def _close_sockets(sockets: list[zmq.Socket]) -> None:
    for socket in sockets:
        if socket is not None:
            socket.close(linger=0)
