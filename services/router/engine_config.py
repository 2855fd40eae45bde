"""Configuration of the router's engine loop (one frozen object, built once in main())."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """What the engine loop needs besides the scheduler.

    attention_endpoint / attention_name: the attention worker that executes every StepPlan.
    required_worker_names: services `/health` depends on (attention and expert workers);
        each must have reported Ready (or a READY heartbeat) to the supervisor and beaten
        within max_heartbeat_silence_s.
    step_timeout_s: bound on one StepPlan round trip; past it the step's requests fail and
        health turns 503 until the attention worker answers a Ping again.
    probe_interval_s / probe_timeout_s: how often and how patiently a failed attention
        worker is pinged to bring health back.
    idle_wait_s: longest sleep of an idle loop (bounds how late deadlines expire).
    eos_token_ids: end a request unless its sampling params say ignore_eos.
    recovery_timeout_s: how long a request waits for a worker that is down (restarting): one
        that arrives meanwhile waits in `submit`, one caught by a failed step before any of its
        tokens went out runs again once the worker answers; past it, EngineError (HTTP 503
        with Retry-After) or an error event naming the cause.
    recovery_poll_s: how often a waiting `submit` reads the health again.
    unavailable_retry_after_s: the Retry-After a client gets with a 503 for a worker that is down.
    """

    attention_endpoint: str
    attention_name: str = "attention-0"
    required_worker_names: tuple[str, ...] = ()
    step_timeout_s: float = 30.0
    max_heartbeat_silence_s: float = 5.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    idle_wait_s: float = 0.25
    eos_token_ids: tuple[int, ...] = ()
    recovery_timeout_s: float = 90.0
    recovery_poll_s: float = 0.1
    unavailable_retry_after_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("step_timeout_s", "max_heartbeat_silence_s", "probe_interval_s", "probe_timeout_s",
                     "idle_wait_s", "recovery_timeout_s", "recovery_poll_s", "unavailable_retry_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
