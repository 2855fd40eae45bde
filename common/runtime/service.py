"""The skeleton every moemesh worker runs: load, announce Ready, serve, heartbeat, drain.

A worker subclasses `Service` and writes two things: `load()` (weights, buffers) and
`handle(message) -> reply | None` (its own `match`). `ServiceRunner` owns everything else:

    load() -> bind endpoint -> Ready to the supervisor -> serve loop (below) -> drain -> exit 0

The serve loop is the one visible loop of the process:

    while state is READY:
        incoming = await next_incoming()           # None once a drain was requested
        match incoming.message:
            case Drain() | Shutdown(): begin draining, Ack
            case Ping(nonce=n):         Pong
            case message:               reply = await service.handle(message)

Messages are handled one at a time (a worker owns one device; overlap belongs inside the
worker's own step). SIGTERM and SIGINT request a drain: nothing new is accepted, the message
being handled finishes and is answered, requests already queued are answered with
ErrorReply(DRAINING) so their senders fail fast, a final Heartbeat(STOPPED) goes out, and the
process exits 0. Malformed messages are dropped by the transport (`wire.dropped`) and the
loop goes on. A handler exception becomes ErrorReply(INTERNAL); the loop goes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import zmq
import zmq.asyncio

from moemesh.common.runtime.load_progress import LoadProgress
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.messages import (
    Ack, Drain, ErrorCode, ErrorReply, Heartbeat, Ping, Pong, Ready, ServiceRole, ServiceState, Shutdown,
)
from moemesh.common.wire.schema import DEFAULT_LIMITS, WireLimits
from moemesh.common.wire.transport import AsyncClient, AsyncServer, Incoming

if TYPE_CHECKING:
    from moemesh.common.security.socket_security import SocketSecurity

log = structlog.get_logger("service")


@dataclass(frozen=True)
class ServiceConfig:
    """What the runner needs; built once in the worker's main() from the Deployment."""

    name: str
    role: ServiceRole
    endpoint: str  # where this service binds
    supervisor_endpoint: str | None  # where Ready and Heartbeat go; None: run unsupervised
    device: str = "cpu"
    heartbeat_interval_s: float = 1.0
    notify_timeout_s: float = 1.0
    limits: WireLimits = DEFAULT_LIMITS
    # How every socket of the runner is secured (CURVE server for `endpoint`, CURVE client of the
    # supervisor); None: plain sockets under the default bind policy (loopback / ipc only).
    security: SocketSecurity | None = None
    # Where load progress is written (`<run_dir>/progress`); None: progress is only logged.
    progress_dir: str | None = None


class Service:
    """Base class of a worker. `accepts` lists the message classes `handle` understands;
    the control messages the runner handles itself are always accepted."""

    accepts: tuple[type, ...] = ()
    # A SendStagingPool for replies that carry tensors; None sends them zero-copy from the
    # reply's own tensors, which the service must then never write again.
    reply_staging: Any = None
    # Set by the runner before load(): pass it as CheckpointReader(on_progress=...) so loading
    # shows per-service progress (common.runtime.load_progress). None outside a runner.
    load_progress: Any = None
    # One line for the Ready message: what the loaded service serves without ("" for nothing)
    ready_detail: str = ""

    async def load(self) -> None:
        """Load weights and allocate buffers; Ready is sent only after this returns."""

    def report_weight_bytes(self, device: Any, resident_bytes: int, stored_bytes: int) -> None:
        """What the held weights occupy on `device` and what they take in the checkpoint (for the log,
        /status.json and the router's `moemesh_worker_weight_bytes`); nothing outside a runner."""
        if self.load_progress is not None:
            self.load_progress.report_weights(str(device), resident_bytes, stored_bytes)

    async def handle(self, message: Any) -> Any:
        """The reply to one message (None for notifications)."""
        return ErrorReply(code=ErrorCode.UNEXPECTED, message=f"{type(message).TYPE} not handled")

    async def close(self) -> None:
        """Release devices and files; called once after the drain."""

    def num_inflight(self) -> int:
        return 0


_RUNNER_MESSAGES = (Drain, Shutdown, Ping)


class ServiceRunner:
    def __init__(self, service: Service, config: ServiceConfig) -> None:
        self.service = service
        self.config = config
        self.state = ServiceState.STARTING
        self._stop_requested: asyncio.Event | None = None
        self._recv_task: asyncio.Task | None = None
        self._heartbeat_sequence = 0

    async def run(self) -> int:
        """Serve until drained; returns the process exit code (0 after a clean drain)."""
        self._stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_drain, signal.Signals(signum).name)
        context = zmq.asyncio.Context()
        server = supervisor = heartbeat_task = authenticator = None
        security = self.config.security
        try:
            progress = LoadProgress(self.config.name, self.config.role.value, self.config.progress_dir)
            self.service.load_progress = progress
            await self.service.load()
            progress.finish()
            if security is not None:
                # before the bind: until the ZAP handler runs, CURVE handshakes are refused
                authenticator = security.start_authenticator(context)
            server = AsyncServer(
                self.config.endpoint,
                context=context,
                limits=self.config.limits,
                accept=(*_RUNNER_MESSAGES, *self.service.accepts),
                security=security,
            )
            if self.config.supervisor_endpoint is not None:
                supervisor = AsyncClient(
                    self.config.supervisor_endpoint, context=context, default_timeout_s=self.config.notify_timeout_s,
                    security=security,
                )
            self.state = ServiceState.READY
            await self._notify(supervisor, self._ready_message())
            log.info("service.ready", name=self.config.name, endpoint=self.config.endpoint)
            heartbeat_task = asyncio.create_task(self._heartbeats(supervisor))
            await self._serve(server)
            await self._refuse_queued(server)
        finally:
            self.state = ServiceState.STOPPED
            if heartbeat_task is not None:
                heartbeat_task.cancel()
            if self._recv_task is not None:
                self._recv_task.cancel()
            await self._notify(supervisor, self._heartbeat_message())
            await self.service.close()
            if supervisor is not None:
                await supervisor.close()
            if server is not None:
                server.close()
            if authenticator is not None:
                authenticator.stop()  # its thread holds a socket of the context
            context.term()
            log.info("service.stopped", name=self.config.name)
        return 0

    def request_drain(self, reason: str = "") -> None:
        """Stop accepting new work; the serve loop exits after the current message."""
        if self.state is ServiceState.READY:
            log.info("service.draining", name=self.config.name, reason=reason)
            self.state = ServiceState.DRAINING
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def _serve(self, server: AsyncServer) -> None:
        while self.state is ServiceState.READY:
            incoming = await self._next_incoming(server)
            if incoming is None:
                break
            match incoming.message:
                case Drain(reason=reason) | Shutdown(reason=reason):
                    self.request_drain(reason or type(incoming.message).TYPE)
                    reply = Ack(detail="draining")
                case Ping(nonce=nonce):
                    reply = Pong(nonce=nonce, name=self.config.name)
                case message:
                    reply = await self._handle_safely(message)
            if incoming.expects_reply and reply is not None:
                await server.reply(incoming, reply, staging=self.service.reply_staging)

    async def _handle_safely(self, message: Any) -> Any:
        try:
            return await self.service.handle(message)
        except Exception as error:  # one failed message must not take the worker down
            log.exception("service.handler_failed", message_type=type(message).TYPE)
            return ErrorReply(code=ErrorCode.INTERNAL, message=f"{type(error).__name__}: {error}"[:300])

    async def _next_incoming(self, server: AsyncServer) -> Incoming | None:
        """The next message, or None once a drain is requested. The receive task survives
        across calls, so a message is never lost to a cancelled receive."""
        if self._recv_task is None:
            self._recv_task = asyncio.create_task(server.recv())
        stop_task = asyncio.create_task(self._stop_requested.wait())
        try:
            await asyncio.wait((self._recv_task, stop_task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_task.cancel()
        if not self._recv_task.done():
            return None
        task, self._recv_task = self._recv_task, None
        return task.result()

    async def _refuse_queued(self, server: AsyncServer) -> None:
        """Answer what is already queued with ErrorReply(DRAINING) instead of leaving it to time out."""
        pending = []
        task, self._recv_task = self._recv_task, None
        if task is not None:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            if not task.cancelled():
                pending.append(task.result())
        pending.extend(await server.recv_queued())
        for incoming in pending:
            if incoming.expects_reply:
                await server.reply(incoming, ErrorReply(code=ErrorCode.DRAINING, message=f"{self.config.name} is draining"))

    async def _heartbeats(self, supervisor: AsyncClient | None) -> None:
        while supervisor is not None:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            await self._notify(supervisor, self._heartbeat_message())

    async def _notify(self, supervisor: AsyncClient | None, message: Any) -> None:
        if supervisor is None:
            return
        try:
            await supervisor.notify(message)
        except ReplyTimeout:
            log.warning("service.supervisor_unreachable", endpoint=supervisor.endpoint, message_type=message.TYPE)

    def _ready_message(self) -> Ready:
        return Ready(
            name=self.config.name, role=self.config.role, pid=os.getpid(),
            endpoint=self.config.endpoint, device=self.config.device, detail=self.service.ready_detail,
        )

    def _heartbeat_message(self) -> Heartbeat:
        self._heartbeat_sequence += 1
        return Heartbeat(
            name=self.config.name, role=self.config.role, state=self.state,
            sequence=self._heartbeat_sequence, num_inflight=self.service.num_inflight(),
        )


def run_service(service: Service, config: ServiceConfig) -> int:
    """Run a service to completion on a uvloop event loop; returns the exit code."""
    import uvloop

    return uvloop.run(ServiceRunner(service, config).run())

