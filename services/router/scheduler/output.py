"""What one `schedule()` hands the attention worker, what comes back, and what the router streams.

Order the worker must follow within a step: (1) swap_out copies (GPU -> CPU, blocks and
resume snapshots), because a GPU block or snapshot freed by a swap-out may be written by this
very step; (2) swap_in copies (CPU -> GPU); (3) state_restores (rebuild a fresh state slot at
a block boundary from its blocks and the snapshot there); (4) compute the scheduled sequences. Slots of freed_request_ids and
preempted_request_ids are free from this step on; a sequence with is_new_sequence set
starts in a slot that must be reset (or restored, when a state restore names it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.scheduler.request import FinishReason


@dataclass(frozen=True)
class ScheduledSequence:
    """One request's share of a step.

    token_ids are computed at positions start_position .. start_position + len - 1; the
    last len(draft_token_ids) of them are drafts to verify. block_ids is the whole GPU block
    table (block i holds positions [i * block_size, (i + 1) * block_size)). sample_logits is
    set only when this chunk reaches the end of the known tokens; then the worker returns
    1 + (accepted drafts) sampled tokens.

    A new sequence (is_new_sequence: first schedule, or again after a preemption or a prefix hit)
    carries its history: prior_token_ids are its tokens at positions 0 .. start_position - 1 (a
    restored prefix, or nothing), and num_prompt_tokens says which of all its tokens are the prompt.
    The worker needs both so that penalties see every token and a seeded request's random streams
    continue at its output count after a preemption, as if it had never been preempted.
    """

    request_id: str
    state_slot: int
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    sample_logits: bool
    draft_token_ids: tuple[int, ...]
    is_new_sequence: bool
    sampling_params: SamplingParams
    prior_token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    # (block index, GPU snapshot): the block ends this step crosses where the worker records a resume snapshot
    snapshot_targets: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class RestoreReason(enum.Enum):
    PREFIX_HIT = "prefix_hit"
    SWAP_IN = "swap_in"


@dataclass(frozen=True)
class StateRestore:
    """Rebuild the state slot of a sequence at the boundary after num_restored_tokens from
    the blocks block_ids (the first num_restored_tokens / block_size of its table) and the
    GPU resume snapshot snapshot_id taken at that boundary."""

    request_id: str
    state_slot: int
    block_ids: tuple[int, ...]
    num_restored_tokens: int
    reason: RestoreReason
    snapshot_id: int


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int
    scheduled: tuple[ScheduledSequence, ...]
    swap_out: tuple[tuple[int, int], ...]  # (gpu_block_id, cpu_block_id)
    swap_in: tuple[tuple[int, int], ...]  # (cpu_block_id, gpu_block_id)
    snapshot_swap_out: tuple[tuple[int, int], ...]  # (gpu snapshot, cpu snapshot), with swap_out
    snapshot_swap_in: tuple[tuple[int, int], ...]  # (cpu snapshot, gpu snapshot), with swap_in
    state_restores: tuple[StateRestore, ...]
    preempted_request_ids: tuple[str, ...]
    freed_request_ids: tuple[str, ...]  # finished or aborted since the previous plan
    num_scheduled_tokens: int
    num_draft_tokens: int
    num_cached_tokens: int  # prefix-cache tokens restored by admissions in this step

    @property
    def is_empty(self) -> bool:
        """Nothing for the worker to do (no compute, no copies, no slot to free)."""
        return not (
            self.scheduled
            or self.swap_out
            or self.swap_in
            or self.preempted_request_ids
            or self.freed_request_ids
        )


@dataclass(frozen=True)
class SequenceResult:
    """The worker's answer for one sampled sequence: the accepted drafts followed by one
    sampled (bonus or replacement) token, so len(sampled_token_ids) == num_accepted_drafts + 1.
    error set means the request failed on the worker."""

    sampled_token_ids: tuple[int, ...] = ()
    num_accepted_drafts: int = 0
    error: str | None = None


@dataclass(frozen=True)
class RequestEvent:
    """What the router streams for one request after a step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    num_draft_tokens: int = 0  # drafts verified in this step
    num_accepted_drafts: int = 0
    error: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
