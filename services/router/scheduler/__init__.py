"""Router-side scheduler and KV block bookkeeping: plain Python over integers.

No torch, no zmq, no asyncio: the router's engine loop calls `Scheduler.schedule()` and
`Scheduler.update()` between its awaits, and the unit tests run in milliseconds.
"""

from moemesh.services.router.scheduler.admission import (
    AdmissionController,
    AdmissionDecision,
    AdmissionLimits,
    RejectReason,
    ThroughputMeter,
    estimate_prompt_tokens,
)
from moemesh.services.router.scheduler.config import SchedulerConfig
from moemesh.services.router.scheduler.metrics import SchedulerCounters, SchedulerStats
from moemesh.services.router.scheduler.output import (
    RequestEvent,
    RestoreReason,
    ScheduledSequence,
    SchedulerOutput,
    SequenceResult,
    StateRestore,
)
from moemesh.services.router.scheduler.request import FinishReason, Request, RequestStatus
from moemesh.services.router.scheduler.scheduler import Scheduler

__all__ = [
    "AdmissionController",
    "AdmissionDecision",
    "AdmissionLimits",
    "FinishReason",
    "RejectReason",
    "Request",
    "RequestEvent",
    "RequestStatus",
    "RestoreReason",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerCounters",
    "SchedulerOutput",
    "SchedulerStats",
    "SequenceResult",
    "StateRestore",
    "ThroughputMeter",
    "estimate_prompt_tokens",
]
