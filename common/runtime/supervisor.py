"""The receiving end of readiness and heartbeats (the router, or `moemesh serve`).

Binds the deployment's supervisor endpoint, records the latest Ready and Heartbeat per
service name, and answers Register with Ack. `wait_ready` waits, with a bound, until named
services reported Ready; `is_alive` tells whether a service beat within a given silence.

With a CURVE `SocketSecurity` the supervisor socket is a CURVE server and the supervisor runs
the ZAP authenticator of its context (the router's only server socket), started before the
bind and stopped in `close()`, before the owner terminates the context.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog
import zmq.asyncio

from moemesh.common.wire.messages import Ack, Heartbeat, Ready, Register, ServiceState
from moemesh.common.wire.transport import AsyncServer

if TYPE_CHECKING:
    from moemesh.common.security.socket_security import SocketSecurity

log = structlog.get_logger("supervisor")


class ReadinessTimeout(Exception):
    """Named services did not report Ready within the bound."""


class Supervisor:
    def __init__(self, endpoint: str, *, context: zmq.asyncio.Context, security: SocketSecurity | None = None) -> None:
        self.authenticator = security.start_authenticator(context) if security is not None else None
        try:
            self.server = AsyncServer(endpoint, context=context, accept=(Ready, Heartbeat, Register),
                                      security=security)
        except BaseException:
            if self.authenticator is not None:
                self.authenticator.stop()
            raise
        self.ready: dict[str, Ready] = {}
        self.registered: dict[str, Register] = {}
        self.heartbeats: dict[str, Heartbeat] = {}
        self.last_seen_s: dict[str, float] = {}  # name -> time.monotonic() of its last message
        self._changed = asyncio.Condition()

    async def run(self) -> None:
        """Receive until cancelled."""
        while True:
            incoming = await self.server.recv()
            match incoming.message:
                case Ready(name=name) as ready:
                    self.ready[name] = ready
                    log.info("supervisor.service_ready", name=name, role=ready.role, pid=ready.pid)
                case Heartbeat(name=name, state=state) as beat:
                    self.heartbeats[name] = beat
                    if state is ServiceState.STOPPED:
                        self.ready.pop(name, None)
                        log.info("supervisor.service_stopped", name=name)
                case Register(name=name) as registration:
                    self.registered[name] = registration
                    await self.server.reply(incoming, Ack(detail="registered"))
            self.last_seen_s[incoming.message.name] = time.monotonic()
            async with self._changed:
                self._changed.notify_all()

    async def wait_ready(self, names: Iterable[str], timeout_s: float) -> dict[str, Ready]:
        wanted = set(names)
        try:
            async with asyncio.timeout(timeout_s):
                async with self._changed:
                    await self._changed.wait_for(lambda: wanted <= set(self.ready))
        except TimeoutError:
            missing = sorted(wanted - set(self.ready))
            raise ReadinessTimeout(f"not ready after {timeout_s:.1f}s: {missing}") from None
        return {name: self.ready[name] for name in wanted}

    def is_alive(self, name: str, max_silence_s: float) -> bool:
        seen_s = self.last_seen_s.get(name)
        return name in self.ready and seen_s is not None and time.monotonic() - seen_s <= max_silence_s

    def close(self) -> None:
        self.server.close()
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
