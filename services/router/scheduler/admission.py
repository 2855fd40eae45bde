"""Admission control: refuse early, before tokenizing, when the waiting queue is full.

The router calls `AdmissionController.decide` with a prompt-length estimate (from the body's
byte length, `estimate_prompt_tokens`) before it spends work on a request; a refusal becomes
HTTP 429 with Retry-After. Retry-after is the time the scheduler needs, at the throughput it
measured recently, to drain the queue back under its bounds; with no recent measurement it is
the maximum, so a cold or stalled server pushes clients away rather than inviting a stampede.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass

from moemesh.services.router.scheduler.config import SchedulerConfig

DEFAULT_BYTES_PER_TOKEN = 4.0


def estimate_prompt_tokens(num_prompt_bytes: int, bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN) -> int:
    """Prompt tokens guessed from the request body's byte length (at least 1)."""
    return max(1, math.ceil(num_prompt_bytes / bytes_per_token))


class ThroughputMeter:
    """Tokens computed per second over the last window_s seconds (fed once per step)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()  # (time_s, num_tokens)
        self._num_tokens_in_window = 0

    def record(self, now_s: float, num_tokens: int) -> None:
        self._samples.append((now_s, num_tokens))
        self._num_tokens_in_window += num_tokens
        self._drop_older_than(now_s - self.window_s)

    def tokens_per_second(self, now_s: float) -> float | None:
        """None when fewer than two samples lie in the window (no rate can be measured)."""
        self._drop_older_than(now_s - self.window_s)
        if len(self._samples) < 2:
            return None
        span_s = max(now_s - self._samples[0][0], 1e-3)
        # The first sample's tokens were produced before the span started.
        return (self._num_tokens_in_window - self._samples[0][1]) / span_s

    def _drop_older_than(self, cutoff_s: float) -> None:
        while self._samples and self._samples[0][0] < cutoff_s:
            _, num_tokens = self._samples.popleft()
            self._num_tokens_in_window -= num_tokens


class RejectReason(enum.Enum):
    TOO_MANY_WAITING_REQUESTS = "too_many_waiting_requests"
    TOO_MANY_WAITING_PROMPT_TOKENS = "too_many_waiting_prompt_tokens"


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: bool
    reject_reason: RejectReason | None = None
    retry_after_seconds: int | None = None  # set only on refusal; HTTP Retry-After is whole seconds


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int
    max_waiting_prompt_tokens: int
    min_retry_after_seconds: int = 1
    max_retry_after_seconds: int = 60

    @classmethod
    def from_scheduler_config(cls, config: SchedulerConfig) -> "AdmissionLimits":
        return cls(config.max_waiting_requests, config.max_waiting_prompt_tokens)


class AdmissionController:
    def __init__(self, limits: AdmissionLimits, meter: ThroughputMeter) -> None:
        self.limits = limits
        self.meter = meter

    def decide(
        self,
        *,
        now_s: float,
        num_waiting_requests: int,
        num_waiting_prompt_tokens: int,
        estimated_prompt_tokens: int,
    ) -> AdmissionDecision:
        """Admit unless the queue would exceed a bound. A prompt larger than the token bound
        is admitted into an empty queue, so no request is refused forever."""
        limits = self.limits
        if num_waiting_requests + 1 > limits.max_waiting_requests:
            num_excess_requests = num_waiting_requests + 1 - limits.max_waiting_requests
            mean_prompt_tokens = num_waiting_prompt_tokens / max(1, num_waiting_requests)
            return self._refuse(
                RejectReason.TOO_MANY_WAITING_REQUESTS, now_s, num_excess_requests * mean_prompt_tokens
            )
        total = num_waiting_prompt_tokens + estimated_prompt_tokens
        if num_waiting_prompt_tokens > 0 and total > limits.max_waiting_prompt_tokens:
            return self._refuse(
                RejectReason.TOO_MANY_WAITING_PROMPT_TOKENS, now_s, total - limits.max_waiting_prompt_tokens
            )
        return AdmissionDecision(admitted=True)

    def _refuse(self, reason: RejectReason, now_s: float, num_tokens_to_drain: float) -> AdmissionDecision:
        limits = self.limits
        tokens_per_s = self.meter.tokens_per_second(now_s)
        if tokens_per_s is None or tokens_per_s <= 0.0:
            seconds = limits.max_retry_after_seconds
        else:
            seconds = math.ceil(num_tokens_to_drain / tokens_per_s)
        seconds = min(max(seconds, limits.min_retry_after_seconds), limits.max_retry_after_seconds)
        return AdmissionDecision(admitted=False, reject_reason=reason, retry_after_seconds=seconds)
