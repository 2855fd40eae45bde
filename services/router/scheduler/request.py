"""One request's scheduling state: token ids, progress, status. Plain data over integers.

Invariant kept by the scheduler: `num_computed_tokens <= num_tokens + len(scheduled drafts)`;
between steps (after `update`) no draft is scheduled and `num_computed_tokens < num_tokens`
for every unfinished request, because the newest sampled token is never computed yet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from moemesh.common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED_SWAPPED = "preempted_swapped"  # full blocks live in the CPU tier
    PREEMPTED_RECOMPUTE = "preempted_recompute"  # everything freed, recompute from 0
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_DEADLINE = "finished_deadline"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished_")


class FinishReason(enum.Enum):
    """Why a request ended; the router maps these onto the API's finish_reason."""

    STOP = "stop"  # EOS or one of the stop token ids
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    DEADLINE = "deadline"
    ERROR = "error"

    @property
    def status(self) -> RequestStatus:
        return _FINISHED_STATUS[self]


_FINISHED_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.DEADLINE: RequestStatus.FINISHED_DEADLINE,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


class TokenGuide(Protocol):
    def advance(self, token_id: int) -> FinishReason | None: ...


@dataclass(eq=False)
class Request:
    """A request as the scheduler sees it.

    arrival_time_s and deadline_s are on the scheduler's clock (time.monotonic by default);
    deadline_s None means no deadline. eos_token_ids come from the tokenizer; they end the
    request unless `sampling_params.ignore_eos`.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time_s: float = 0.0
    deadline_s: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Speculative tokens proposed by the drafter for the next verification; never part of
    # num_tokens, never hashed into the prefix cache.
    draft_token_ids: list[int] = field(default_factory=list)
    # Tokens restored from the prefix cache when the request was last admitted.
    num_cached_prefix_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Chain hashes of this request's full, computed blocks (index i covers tokens
    # [i * block_size, (i + 1) * block_size)); grows as blocks fill.
    block_hashes: list[bytes] = field(default_factory=list)
    # Constrained decoding (services/router/guided_decoding.py): advance(token_id) follows every
    # appended token and returns STOP when the grammar is complete, ERROR for a refused token.
    guide: TokenGuide | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt + output (drafts excluded)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_id_at(self, position: int) -> int:
        if position < len(self.prompt_token_ids):
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - len(self.prompt_token_ids)]

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Known token ids at positions [start, end) (drafts excluded)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return list(self.prompt_token_ids[start:end])
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return list(self.prompt_token_ids[start:]) + self.output_token_ids[: end - num_prompt]
