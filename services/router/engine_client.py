"""The gateway's view of the engine loop: what it submits and what comes back.

The HTTP layer (app.py) programs against `EngineClient` only. The engine loop (scheduler +
wire layer, built elsewhere) implements it. Contract:

- `submit(request)` is awaited once per sequence and returns an async iterator of
  `TokenEvent`s. The iterator ends after the event whose `finish_reason` is set; exactly one
  event has it. An engine failure is reported either by raising `EngineError` (from
  `submit` or from the iterator) or by a final event with `finish_reason=FinishReason.ERROR`.
- `abort(request_id)` stops a sequence (client gone, stop string matched, deadline). It
  must be idempotent and harmless for unknown or finished ids; after it the iterator ends
  (with an ABORT event, or simply stops).
- `health()`, `admission_check()` and `stats()` are cheap and synchronous: they read state
  the engine loop already keeps. `admission_check` is called before tokenizing, so a
  refusal costs nothing.
- Token ids in events are the sampled ids, EOS included when generation stopped on it.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from moemesh.common.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # aborted (client gone, deadline)
    ERROR = "error"  # the engine failed this sequence


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate. `n` > 1 is fanned out by the gateway into n of these."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    deadline_unix_s: float | None = None  # time.time() after which the engine may abort it
    guide: Any = None  # constrained decoding: a guided_decoding.TokenGuide of this sequence alone


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class Usage:
    """Cumulative counters of one sequence (the values at the time of the event)."""

    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class SpeculativeStats:
    ran: bool
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_length: float = 0.0  # tokens accepted per verification step, bonus included

    def to_json(self) -> dict:
        return {
            "ran": self.ran,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "mean_accepted_length": self.mean_accepted_length,
        }


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one sequence since its previous event.

    `logprobs` has one entry per new token when logprobs were asked for (else None);
    `top_logprobs` likewise, each a tuple of up to `num_logprobs` alternatives.
    `speculative` is set on the final event.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[TopLogprob, ...], ...] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    speculative: SpeculativeStats | None = None
    error_message: str | None = None  # with FinishReason.ERROR

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class HealthReport:
    ok: bool
    services: dict[str, str] = field(default_factory=dict)  # service name -> "ok" or what is wrong


@dataclass(frozen=True)
class Rejection:
    """Admission refused: the gateway answers 429 with Retry-After."""

    reason: str
    retry_after_s: float


class EngineError(RuntimeError):
    """The engine could not serve a request (worker down, retries exhausted, ...).
    `retry_after_s`: when the client may try again (the gateway's Retry-After), None: not said."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineClient(Protocol):
    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> HealthReport: ...

    def admission_check(self, estimated_prompt_tokens: int) -> Rejection | None: ...

    def stats(self) -> dict:
        """Engine counters for /metrics; every key is optional:

        `num_waiting`, `num_running` (ints); `kv_blocks_used`, `kv_blocks_total`,
        `kv_snapshots_used`, `kv_snapshots_cached`, `kv_snapshots_total` ({tier: int}, tiers such as "gpu", "cpu"); `prefix_cache_queried_tokens`,
        `prefix_cache_hit_tokens` (cumulative ints); `spec_draft_by_position`,
        `spec_accepted_by_position` (cumulative lists, index = draft position).
        """
        ...
