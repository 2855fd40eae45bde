"""Control channel messages: registration, readiness, liveness, shutdown, and the generic replies.

Part of the wire vocabulary registered in `common/wire/messages.py` (see its docstring for the
field types the codec understands); imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moemesh.common.wire.message_enums import ServiceRole, ServiceState, ErrorCode


@dataclass(frozen=True)
class Register:
    """A worker announces itself to the router: who it is and where it listens."""

    TYPE: ClassVar[str] = "register"
    name: str
    role: ServiceRole
    pid: int
    host: str
    device: str
    endpoint: str


@dataclass(frozen=True)
class Ready:
    """Sent once by a service when it has loaded everything and accepts work. `detail`: what it
    serves without, in one line ("" for nothing; an attention worker whose in-process drafter failed
    to load says "drafter failed: <why>")."""

    TYPE: ClassVar[str] = "ready"
    name: str
    role: ServiceRole
    pid: int
    endpoint: str
    device: str = "cpu"
    detail: str = ""


@dataclass(frozen=True)
class Heartbeat:
    """Periodic liveness report; `sequence` increases by one per beat from each sender."""

    TYPE: ClassVar[str] = "heartbeat"
    name: str
    role: ServiceRole
    state: ServiceState
    sequence: int
    num_inflight: int = 0


@dataclass(frozen=True)
class Drain:
    """Ask a service to stop accepting work, finish what is in flight, then exit 0."""

    TYPE: ClassVar[str] = "drain"
    reason: str = ""


@dataclass(frozen=True)
class Shutdown:
    """Ask a service to exit now; in-flight work is answered with ErrorReply(DRAINING)."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""


@dataclass(frozen=True)
class Ping:
    """Liveness probe answered by `Pong` with the same nonce."""

    TYPE: ClassVar[str] = "ping"
    nonce: int


@dataclass(frozen=True)
class Pong:
    TYPE: ClassVar[str] = "pong"
    nonce: int
    name: str = ""


@dataclass(frozen=True)
class Ack:
    """Generic positive reply to a request that has no richer answer (Register, Drain, ...)."""

    TYPE: ClassVar[str] = "ack"
    detail: str = ""


@dataclass(frozen=True)
class ErrorReply:
    """The reply to a request that failed; `request_id` names the client request if any."""

    TYPE: ClassVar[str] = "error"
    code: ErrorCode
    message: str
    request_id: str | None = None
