"""The scheduler: which requests compute how many tokens each step, under budgets and pools.

There is no prefill or decode mode: every request has num_computed_tokens and num_tokens
(+ drafts to verify) and each step lets the first catch up with the second, in chunks of at
most long_prefill_token_threshold tokens, under a step budget of max_num_batched_tokens.

Policy, in priority order:
  1. running requests (admission order), decodes before continuing prefills;
  2. swapped requests (FCFS), brought back before anything new is admitted;
  3. waiting requests (FCFS; recompute-preempted ones go back to the front).
A short prompt does not wait behind a long one (short_requests.py): running long prompts sit
out the step a short waiting head starts in, and their chunks shrink while short requests are
about.
When a running request needs a block and none is free, the lowest-priority running
request (the last admitted) is preempted: its full blocks and the resume snapshot at their
end go to the CPU tier if it has room (swap), otherwise everything is freed and it starts
over (recompute; its keyed blocks stay in the prefix cache, so the restart is usually cheap).
No step both preempts and admits.

Why this never deadlocks: the config guarantees one request at max_model_len fits the GPU
pool alone, and the highest-priority running request is never chosen as a victim while
another request holds blocks, so it can always grow until it finishes. A swapped or waiting
head fits once nothing runs. (tests/test_scheduler_fuzz.py runs this down to tiny pools.)

Protocol: schedule() and update() strictly alternate; update() may be called with an empty
output, and should be called every engine iteration so deadlines expire.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from moemesh.services.router.scheduler.admission import (
    AdmissionController,
    AdmissionDecision,
    AdmissionLimits,
    ThroughputMeter,
)
from moemesh.services.router.scheduler.config import SchedulerConfig
from moemesh.services.router.scheduler.kv_manager import KVBlockManager, TierMove
from moemesh.services.router.scheduler.metrics import SchedulerCounters, SchedulerStats, collect_stats
from moemesh.services.router.scheduler.output import (
    RequestEvent,
    RestoreReason,
    ScheduledSequence,
    SchedulerOutput,
    SequenceResult,
    StateRestore,
)
from moemesh.services.router.scheduler.request import FinishReason, Request, RequestStatus
from moemesh.services.router.scheduler.short_requests import ShortRequestPolicy
from moemesh.services.router.scheduler.budget import StepChunking, chunk_cap, graph_chunks_fit, num_tokens_to_compute
from moemesh.services.router.scheduler.stop_checks import append_sampled_tokens, result_problem


@dataclass
class _Swaps:
    """One direction of a step's copies between the tiers: block pairs and resume snapshot pairs."""

    blocks: list[tuple[int, int]]
    snapshots: list[tuple[int, int]]

    def add(self, move: TierMove) -> None:
        self.blocks.extend(move.block_pairs)
        self.snapshots.append(move.snapshot_pair)


@dataclass
class _Planned:
    """A tentative entry of the step being built (finalised at the end of schedule())."""

    request: Request
    num_new_tokens: int
    num_drafts: int
    is_new_sequence: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.kv = KVBlockManager(config)
        self.counters = SchedulerCounters()
        self.meter = ThroughputMeter()
        self.admission = AdmissionController(AdmissionLimits.from_scheduler_config(config), self.meter)
        self._requests: dict[str, Request] = {}
        self._arrival_order: dict[str, int] = {}
        self._next_arrival = itertools.count()
        self._waiting: deque[Request] = deque()
        self._num_waiting_prompt_tokens = 0
        self._swapped: list[Request] = []  # sorted by arrival order
        self._running: list[Request] = []  # priority order: first admitted first
        self._deadline_ids: set[str] = set()
        self._freed_ids: list[str] = []  # slots to announce in the next plan
        self._step_ids = itertools.count(1)
        self._in_flight: SchedulerOutput | None = None
        self.short_requests = ShortRequestPolicy(config)
        self.chunking = StepChunking()  # the chunk caps of the step planned last (set at its start)

    # -- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError if it can never run."""
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not fresh")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        self._requests[request.request_id] = request
        self._arrival_order[request.request_id] = next(self._next_arrival)
        self._enqueue_waiting(request, front=False)
        self.short_requests.note_arrival(request, self.clock())
        if request.deadline_s is not None:
            self._deadline_ids.add(request.request_id)

    def abort(self, request_id: str) -> RequestEvent | None:
        """End a request wherever it is and free every block and slot it holds. None if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, FinishReason.ABORT, ())

    def set_draft_tokens(self, request_id: str, draft_token_ids: list[int]) -> None:
        """Drafts to verify at the request's next step (replacing older ones)."""
        request = self._requests.get(request_id)
        if request is not None and request.status is RequestStatus.RUNNING:
            request.draft_token_ids = list(draft_token_ids)

    def check_admission(self, estimated_prompt_tokens: int) -> AdmissionDecision:
        return self.admission.decide(
            now_s=self.clock(),
            num_waiting_requests=len(self._waiting),
            num_waiting_prompt_tokens=self._num_waiting_prompt_tokens,
            estimated_prompt_tokens=estimated_prompt_tokens,
        )

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called before update() of the previous step")
        budget = [self.config.max_num_batched_tokens]  # boxed: helpers refund into it
        planned: dict[str, _Planned] = {}
        swap_out = _Swaps([], [])
        preempted_ids: list[str] = []
        sitting_out = self.short_requests.begin_step(self.clock(), self._waiting, self._running, bool(self._swapped))
        num_live = len(self._running) + len(self._swapped) + len(self._waiting)
        self.chunking = StepChunking(self.short_requests.about, graph_chunks_fit(self.config, num_live))
        self._schedule_running(planned, budget, swap_out, preempted_ids,
                               lambda request: request.request_id not in sitting_out)
        swap_in = _Swaps([], [])
        restores: list[StateRestore] = []
        num_cached_tokens = 0
        if not preempted_ids:
            self._schedule_swapped(planned, budget, swap_in, restores)
            if not self._swapped:
                num_cached_tokens = self._schedule_waiting(planned, budget, restores)
        if sitting_out and not any(entry.is_new_sequence for entry in planned.values()):
            # nothing new was admitted after all: the long prompts go on this step
            self._schedule_running(planned, budget, swap_out, preempted_ids,
                                   lambda request: request.request_id in sitting_out)
            sitting_out = frozenset()
        self.short_requests.end_step(sitting_out)
        return self._finalise(planned, swap_out, swap_in, restores, preempted_ids, num_cached_tokens)

    def _schedule_running(self, planned, budget, swap_out, preempted_ids, takes_part) -> None:
        """takes_part(request): whether a running request is scheduled in this pass."""
        decodes, prefills = [], []
        for request in self._running:
            if not takes_part(request):
                continue
            (decodes if request.num_tokens - request.num_computed_tokens == 1 else prefills).append(request)
        for request in itertools.chain(decodes, prefills):
            if budget[0] == 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new, num_drafts = num_tokens_to_compute(request, self.config, budget[0], self.chunking)
            total = request.num_computed_tokens + num_new
            while not self.kv.grow(request.request_id, total):
                victim = self._running[-1]
                self._preempt(victim, planned, budget, swap_out, preempted_ids)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                planned[request.request_id] = _Planned(request, num_new, num_drafts, False)
                budget[0] -= num_new

    def _schedule_swapped(self, planned, budget, swap_in, restores) -> None:
        while self._swapped and budget[0] > 0 and len(self._running) < self.config.max_num_running_seqs:
            request = self._swapped[0]
            num_new, _ = num_tokens_to_compute(request, self.config, budget[0], self.chunking)
            total = request.num_computed_tokens + num_new
            if not self.kv.can_swap_in(request.request_id, total):
                return
            self._swapped.pop(0)
            move, slot = self.kv.swap_in(request.request_id, total)
            swap_in.add(move)
            num_restored_blocks = request.num_computed_tokens // self.config.block_size_tokens
            restores.append(
                StateRestore(
                    request.request_id,
                    slot,
                    tuple(self.kv.gpu_block_ids(request.request_id)[:num_restored_blocks]),
                    request.num_computed_tokens,
                    RestoreReason.SWAP_IN,
                    move.snapshot_pair[1],
                )
            )
            self._start_running(request, planned, budget, num_new)

    def _schedule_waiting(self, planned, budget, restores) -> int:
        num_cached_tokens = 0
        block_size = self.config.block_size_tokens
        while self._waiting and budget[0] > 0 and len(self._running) < self.config.max_num_running_seqs:
            request = self._waiting[0]
            prefix = self.kv.find_cached_prefix(request)
            num_cached = len(prefix.block_ids) * block_size
            num_new = min(request.num_tokens - num_cached,
                          chunk_cap(request, self.config, self.chunking, num_cached), budget[0])
            if not self.kv.can_admit(prefix, num_cached + num_new):
                break
            self._waiting.popleft()
            self._num_waiting_prompt_tokens -= request.num_tokens
            slot = self.kv.admit(request, prefix, num_cached + num_new)
            request.num_computed_tokens = num_cached
            request.num_cached_prefix_tokens = num_cached
            num_cached_tokens += num_cached
            if num_cached:
                restores.append(
                    StateRestore(
                        request.request_id, slot, prefix.block_ids, num_cached, RestoreReason.PREFIX_HIT,
                        prefix.snapshot_id,
                    )
                )
            self._start_running(request, planned, budget, num_new)
        return num_cached_tokens

    def _start_running(self, request: Request, planned, budget, num_new: int) -> None:
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        planned[request.request_id] = _Planned(request, num_new, 0, True)
        budget[0] -= num_new

    def _preempt(self, victim: Request, planned, budget, swap_out, preempted_ids) -> None:
        self._running.remove(victim)
        entry = planned.pop(victim.request_id, None)
        if entry is not None:
            budget[0] += entry.num_new_tokens
        victim.draft_token_ids = []
        victim.num_preemptions += 1
        preempted_ids.append(victim.request_id)
        num_full_blocks = victim.num_computed_tokens // self.config.block_size_tokens
        if self.kv.can_swap_out(victim.request_id, num_full_blocks):
            swap_out.add(self.kv.swap_out(victim.request_id, num_full_blocks))
            victim.num_computed_tokens = num_full_blocks * self.config.block_size_tokens
            victim.status = RequestStatus.PREEMPTED_SWAPPED
            order = self._arrival_order
            bisect.insort(self._swapped, victim, key=lambda r: order[r.request_id])
            self.counters.num_preemptions_swap += 1
        else:
            self.kv.free_request(victim.request_id)
            victim.num_computed_tokens = 0
            self._enqueue_waiting(victim, front=True)
            victim.status = RequestStatus.PREEMPTED_RECOMPUTE
            self.counters.num_preemptions_recompute += 1

    def _finalise(self, planned, swap_out, swap_in, restores, preempted_ids, num_cached_tokens) -> SchedulerOutput:
        scheduled = []
        num_draft_tokens = 0
        for entry in planned.values():
            request = entry.request
            start = request.num_computed_tokens
            num_known = entry.num_new_tokens - entry.num_drafts
            drafts = tuple(request.draft_token_ids[: entry.num_drafts])
            request.draft_token_ids = list(drafts)
            token_ids = tuple(request.token_ids_between(start, start + num_known)) + drafts
            request.num_computed_tokens = start + entry.num_new_tokens
            num_draft_tokens += len(drafts)
            snapshot_targets = self.kv.snapshot_targets(request, start, request.num_computed_tokens)
            scheduled.append(
                ScheduledSequence(
                    request_id=request.request_id,
                    state_slot=self.kv.state_slot(request.request_id),
                    token_ids=token_ids,
                    start_position=start,
                    block_ids=tuple(self.kv.gpu_block_ids(request.request_id)),
                    sample_logits=start + num_known == request.num_tokens,
                    draft_token_ids=drafts,
                    is_new_sequence=entry.is_new_sequence,
                    sampling_params=request.sampling_params,
                    prior_token_ids=tuple(request.token_ids_between(0, start)) if entry.is_new_sequence else (),
                    num_prompt_tokens=len(request.prompt_token_ids),
                    snapshot_targets=snapshot_targets,
                )
            )
        freed_ids, self._freed_ids = tuple(self._freed_ids), []
        self.counters.num_steps += 1
        self.counters.num_draft_tokens += num_draft_tokens
        output = SchedulerOutput(
            step_id=next(self._step_ids),
            scheduled=tuple(scheduled),
            swap_out=tuple(swap_out.blocks),
            swap_in=tuple(swap_in.blocks),
            snapshot_swap_out=tuple(swap_out.snapshots),
            snapshot_swap_in=tuple(swap_in.snapshots),
            state_restores=tuple(restores),
            preempted_request_ids=tuple(preempted_ids),
            freed_request_ids=freed_ids,
            num_scheduled_tokens=sum(s.num_tokens for s in scheduled),
            num_draft_tokens=num_draft_tokens,
            num_cached_tokens=num_cached_tokens,
        )
        self._in_flight = output
        return output

    # -- results back ---------------------------------------------------------------------
    def update(self, output: SchedulerOutput, results: Mapping[str, SequenceResult]) -> list[RequestEvent]:
        """Apply a step's results: append tokens, roll back rejected drafts, finish requests.
        Returns the events to stream, at most one per request."""
        if output is not self._in_flight:
            raise RuntimeError("update() must receive the output of the last schedule()")
        self._in_flight = None
        events: list[RequestEvent] = []
        num_confirmed = 0
        for seq in output.scheduled:
            request = self._requests.get(seq.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            result = results.get(seq.request_id)
            if not seq.sample_logits:
                if result is not None and result.error is not None:
                    events.append(self._finish(request, FinishReason.ERROR, (), error=result.error))
                    continue
                num_confirmed += seq.num_tokens
                self.kv.settle(request)
                continue
            problem = result_problem(seq, result)
            if problem is not None:
                events.append(self._finish(request, FinishReason.ERROR, (), error=problem))
                continue
            num_rejected = len(seq.draft_token_ids) - result.num_accepted_drafts
            request.num_computed_tokens -= num_rejected
            request.draft_token_ids = []
            num_confirmed += seq.num_tokens - num_rejected
            self.counters.num_accepted_drafts += result.num_accepted_drafts
            appended, reason = append_sampled_tokens(request, result.sampled_token_ids, self.config.max_model_len)
            if reason is not None:
                error = "a sampled token breaks the response_format grammar" if reason is FinishReason.ERROR else None
                if error is None:  # its confirmed blocks and last snapshot stay cached for a next turn
                    self.kv.settle(request)
                events.append(self._finish(request, reason, appended, seq, result.num_accepted_drafts, error))
                continue
            self.kv.trim(request.request_id, request.num_computed_tokens)
            self.kv.settle(request)
            events.append(
                RequestEvent(
                    request.request_id,
                    tuple(appended),
                    num_draft_tokens=len(seq.draft_token_ids),
                    num_accepted_drafts=result.num_accepted_drafts,
                )
            )
        now_s = self.clock()
        self.counters.num_computed_tokens += num_confirmed
        self.meter.record(now_s, num_confirmed)
        events.extend(self.expire_deadlines(now_s))
        return events

    def expire_deadlines(self, now_s: float | None = None) -> list[RequestEvent]:
        """Finish every request whose deadline has passed (called by update())."""
        if not self._deadline_ids:
            return []
        now_s = self.clock() if now_s is None else now_s
        expired = [
            self._requests[request_id]
            for request_id in self._deadline_ids
            if self._requests[request_id].deadline_s <= now_s
        ]
        return [self._finish(request, FinishReason.DEADLINE, ()) for request in expired]

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        new_token_ids,
        seq: ScheduledSequence | None = None,
        num_accepted_drafts: int = 0,
        error: str | None = None,
    ) -> RequestEvent:
        """Remove the request from every queue and give back all it holds."""
        match request.status:
            case RequestStatus.RUNNING:
                self._running.remove(request)
            case RequestStatus.PREEMPTED_SWAPPED:
                self._swapped.remove(request)
            case RequestStatus.WAITING | RequestStatus.PREEMPTED_RECOMPUTE:
                self._waiting.remove(request)
                self._num_waiting_prompt_tokens -= request.num_tokens
        if self.kv.state_slot(request.request_id) is not None:
            self._freed_ids.append(request.request_id)
        self.kv.free_request(request.request_id)
        request.status = reason.status
        request.finish_reason = reason
        request.draft_token_ids = []
        del self._requests[request.request_id]
        del self._arrival_order[request.request_id]
        self._deadline_ids.discard(request.request_id)
        if reason is FinishReason.ABORT:
            self.counters.num_aborted_requests += 1
        else:
            self.counters.num_finished_requests += 1
        return RequestEvent(
            request.request_id,
            tuple(new_token_ids),
            finish_reason=reason,
            num_draft_tokens=len(seq.draft_token_ids) if seq is not None else 0,
            num_accepted_drafts=num_accepted_drafts,
            error=error,
        )

    def _enqueue_waiting(self, request: Request, *, front: bool) -> None:
        request.status = RequestStatus.WAITING
        if front:
            self._waiting.appendleft(request)
        else:
            self._waiting.append(request)
        self._num_waiting_prompt_tokens += request.num_tokens

    # -- inspection -------------------------------------------------------------------------
    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def stats(self) -> SchedulerStats:
        return collect_stats(self.kv, self.counters, self._waiting, self._num_waiting_prompt_tokens,
                             len(self._running), len(self._swapped))
