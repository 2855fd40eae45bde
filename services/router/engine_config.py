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

    def __post_init__(self) -> None:
        for name in ("step_timeout_s", "max_heartbeat_silence_s", "probe_interval_s", "probe_timeout_s",
                     "idle_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
