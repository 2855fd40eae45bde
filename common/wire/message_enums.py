"""Enumerations carried inside wire messages (`common/wire/messages.py` lists the messages).

StrEnums travel as their string value; the decoder refuses a value outside the enum.
"""

from __future__ import annotations

from enum import StrEnum

class ServiceRole(StrEnum):
    ROUTER = "router"
    ATTENTION = "attention"
    EXPERT = "expert"
    DRAFT = "draft"
    SUPERVISOR = "supervisor"


class ServiceState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


class RoutingPhase(StrEnum):
    """Which tokens a routing count covers: prompt tokens, generated tokens, or both."""

    PREFILL = "prefill"
    DECODE = "decode"
    ALL = "all"


class ErrorCode(StrEnum):
    MALFORMED = "malformed"  # the request could not be decoded
    UNEXPECTED = "unexpected"  # decoded, but this receiver does not handle that type
    DRAINING = "draining"  # the receiver is shutting down and accepts nothing new
    OVERLOADED = "overloaded"
    NOT_FOUND = "not_found"  # e.g. an expert that this worker does not hold
    INTERNAL = "internal"
