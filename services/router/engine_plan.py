"""Scheduler output <-> wire messages: the router's side of the StepPlan / StepResult contract.

The scheduler speaks in requests (`SchedulerOutput`, `services.router.scheduler.output`);
the attention worker speaks in state slots (`StepPlan`, `common.wire.messages`). Two
differences need care:

- Slot release. The scheduler frees a finished request's slot at once, so the next
  `schedule()` may give that slot to a new request in the same step that announces the
  release; the wire releases `free_seq_slots` *after* the step. A slot that is both
  released and reused in one step is therefore released by a separate plan sent first
  (no sequences, only `free_seq_slots`), so the worker never sees a new request on a slot
  it still attributes to the old one, whatever order it applies things in.
- Sampling parameters travel only when a sequence (re)starts in a slot
  (`is_new_sequence`): the worker keeps them per slot.

Both prefix-cache hits and swap-ins become `PrefixRestore`s: in either case the worker
rebuilds a fresh slot at a block boundary from blocks already in the GPU pool.
Pure Python over integers, no I/O: tested without any worker.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from moemesh.common.wire.messages import DraftProposal, PrefixRestore, StepPlan, StepResult, TokenLogprobs
from moemesh.common.wire.messages import ScheduledSequence as WireSequence
from moemesh.services.router.scheduler import SchedulerOutput, SequenceResult


class PlanTranslator:
    """Turns each SchedulerOutput into the StepPlans to send, in order.

    Keeps which slot each request holds on the worker (learned from the plans it built), so
    `freed_request_ids` / `preempted_request_ids` become `free_seq_slots`. Wire step ids are
    its own counter, because one scheduler step may need two plans.
    """

    def __init__(self, client_request_id: Callable[[str], str | None] | None = None) -> None:
        """client_request_id: the HTTP request id (X-Request-Id) of a sequence, sent with its first
        schedule so the worker's log events name it; None: not sent."""
        self._slot_of: dict[str, int] = {}
        self._step_ids = itertools.count(1)
        self._client_request_id = client_request_id

    @property
    def num_slots_held(self) -> int:
        return len(self._slot_of)

    def plans_for(self, output: SchedulerOutput) -> list[StepPlan]:
        released = []
        for request_id in (*output.freed_request_ids, *output.preempted_request_ids):
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                released.append(slot)
        reused = {seq.state_slot for seq in output.scheduled}
        plans = []
        release_first = tuple(slot for slot in released if slot in reused)
        if release_first:
            plans.append(StepPlan(step_id=next(self._step_ids), sequences=(), free_seq_slots=release_first))
        sequences = []
        for seq in output.scheduled:
            self._slot_of[seq.request_id] = seq.state_slot
            sequences.append(
                WireSequence(
                    request_id=seq.request_id,
                    seq_slot=seq.state_slot,
                    token_ids=seq.token_ids,
                    start_position=seq.start_position,
                    block_ids=(seq.block_ids,),  # one tier: the GPU pool (index 0)
                    do_sample=seq.sample_logits,
                    sampling=seq.sampling_params.to_wire() if seq.is_new_sequence else None,
                    draft_token_ids=seq.draft_token_ids,
                    prior_token_ids=seq.prior_token_ids if seq.is_new_sequence else (),
                    num_prompt_tokens=seq.num_prompt_tokens if seq.is_new_sequence else None,
                    client_request_id=(self._client_request_id(seq.request_id)
                                       if seq.is_new_sequence and self._client_request_id is not None else None),
                    snapshot_targets=seq.snapshot_targets,
                )
            )
        restores = tuple(
            PrefixRestore(
                request_id=restore.request_id,
                seq_slot=restore.state_slot,
                block_ids=restore.block_ids,
                num_tokens=restore.num_restored_tokens,
                snapshot_id=restore.snapshot_id,
            )
            for restore in output.state_restores
        )
        plans.append(
            StepPlan(
                step_id=next(self._step_ids),
                sequences=tuple(sequences),
                swap_out=output.swap_out,
                swap_in=output.swap_in,
                snapshot_swap_out=output.snapshot_swap_out,
                snapshot_swap_in=output.snapshot_swap_in,
                free_seq_slots=tuple(slot for slot in released if slot not in reused),
                prefix_restores=restores,
            )
        )
        return plans


@dataclass(frozen=True)
class TranslatedResult:
    """A StepResult in the scheduler's terms, plus the logprobs the scheduler does not keep."""

    sequence_results: dict[str, SequenceResult]
    logprobs: dict[str, TokenLogprobs]
    failure: str | None = None  # set when the step was not executed; every request in it failed
    worker_lost: bool = False  # with failure: the worker did not answer or restarted (not a refusal)
    # drafter in the attention worker: the next drafts by request id, and the seconds drafting took
    next_drafts: dict[str, DraftProposal] = field(default_factory=dict)
    draft_s: float = 0.0


class ResultMismatch(Exception):
    """The worker answered another step than the one asked (a protocol bug, not a timeout)."""


def translate_result(plan: StepPlan, result: StepResult) -> TranslatedResult:
    """Map the worker's answer to one plan onto scheduler SequenceResults.

    Sequences the plan did not schedule are ignored; a sampled sequence without an answer is
    left out, and the scheduler fails it ("no result for a sampled sequence").
    """
    if result.step_id != plan.step_id:
        raise ResultMismatch(f"step_result {result.step_id} for step_plan {plan.step_id}")
    scheduled_ids = {seq.request_id for seq in plan.sequences}
    sequence_results: dict[str, SequenceResult] = {}
    logprobs: dict[str, TokenLogprobs] = {}
    next_drafts: dict[str, DraftProposal] = {}
    for answer in result.sequences:
        if answer.request_id not in scheduled_ids:
            continue
        sequence_results[answer.request_id] = SequenceResult(
            sampled_token_ids=tuple(answer.token_ids),
            num_accepted_drafts=answer.num_draft_accepted,
            error=answer.error,
        )
        if answer.logprobs is not None:
            logprobs[answer.request_id] = answer.logprobs
        if answer.next_drafts is not None and answer.error is None:
            next_drafts[answer.request_id] = answer.next_drafts
    return TranslatedResult(sequence_results, logprobs, next_drafts=next_drafts, draft_s=result.draft_s)


def failed_results(output: SchedulerOutput, message: str) -> Mapping[str, SequenceResult]:
    """Results that make `Scheduler.update` end every scheduled request with this error."""
    return {seq.request_id: SequenceResult(error=message) for seq in output.scheduled}
