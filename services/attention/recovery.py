"""Step-level recovery of the attention worker from a lost expert worker.

An expert worker that dies or stops answering shows up as a dispatch that times out
(`ReplyTimeout`) or is refused (`DispatchError`, e.g. DRAINING while it shuts down). The step
that hit it is then in an unknown, partial state: some layers' stores advanced, others not.
`StepRecovery.run` makes that step atomic again:

    move KV blocks once (swap_out, swap_in)
    for attempt in 1..max_attempts:
        mark every slot of the plan (tokens, prompt / output ids)
        try: return compute(plan)
        except a lost expert worker:
            roll every sequence back to its mark   (rollback_slot; KV blocks written this step
                                                     are simply overwritten by the retry)
            forget the channel's in-flight tickets (their late replies are then dropped)
            mark the worker down (failover.py); if every pair it held has a live replica,
                retry at once: its pairs go to the replicas
            else wait until the down workers answer again with their pairs loaded (a
                restarted one), probing every probe_interval_s
    give up: every sequence of the plan ends with an error naming the cause

Invariants and reasons:
- The budget is bounded in wall time from the start of the step (`budget_s`) and in attempts,
  so a dead worker that never comes back turns into clean per-sequence errors before the
  router's step timeout fires (the worst case is about `budget_s + dispatch timeout`);
  `budget_for(step_s, dispatch_s)` picks a budget that fits.
- A sequence that started this step at position 0 needs no rollback: its slot is dropped and
  the retry re-initialises it. Any other sequence rolls each store back by what it advanced;
  `SequenceState` retains only `max_rollback_tokens` (8) tokens of history, so a continuing
  prefill chunk longer than that cannot be undone and that one sequence fails with an error
  (the rest of the step is retried).
- Sampling happens after the whole forward; a failed attempt has sampled a token only when a step
  graph's mailbox outcome is read after sampling (`confirm_deferred`), and the rollback drops it
  (output ids back to the mark). Draws are keyed by seed and position, so the retry draws exactly
  what the first attempt would have drawn.
- Retrying on replicas needs no wait, so a worker with a live twin costs one dispatch timeout
  per step that hit it; the dead worker stays out of the tables until a probe finds it back.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from moemesh.common.model.state import RollbackError, SequenceState
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.messages import SequenceResult, StepPlan, StepResult
from moemesh.services.attention.dispatch_tickets import DispatchError

if TYPE_CHECKING:
    from moemesh.services.attention.slots import SlotTable

log = structlog.get_logger("attention")

LOST_EXPERT_ERRORS = (ReplyTimeout, DispatchError)


@dataclass(frozen=True)
class RecoveryConfig:
    """max_attempts: executions of one step, the first included (1 turns recovery off).
    budget_s: wall time from the start of the step after which no new attempt starts.
    probe_interval_s / probe_timeout_s: how often and how patiently dead workers are pinged."""

    max_attempts: int = 3
    budget_s: float = 20.0
    probe_interval_s: float = 0.2
    probe_timeout_s: float = 0.5
    readmit_interval_s: float = 2.0  # while a worker is down, probe it before a step at most this often
    readmit_timeout_s: float = 0.1  # how long that probe waits (a dead endpoint costs this per interval)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if (self.budget_s < 0 or self.probe_interval_s <= 0 or self.probe_timeout_s <= 0
                or self.readmit_interval_s <= 0 or self.readmit_timeout_s <= 0):
            raise ValueError("recovery times must be positive")


def budget_for(step_timeout_s: float, dispatch_timeout_s: float) -> float:
    """A recovery budget that ends before the router's step timeout: the last attempt may still
    take one dispatch timeout after the budget, and the reply needs a margin to travel."""
    return max(0.0, step_timeout_s - 2 * dispatch_timeout_s - 1.0)


@dataclass(frozen=True)
class SlotMark:
    """Where one slot stood before an attempt."""

    request_id: str
    num_tokens: int
    num_prompt_ids: int
    num_output_ids: int


def rollback_state(state: SequenceState, num_tokens: int) -> None:
    """Bring every store of `state` (some may have advanced further than others) back to
    `num_tokens`. Raises RollbackError when a store no longer retains that position."""
    for layer in state.layers:
        for store in layer.stores():
            excess = store.num_tokens - num_tokens
            if excess > 0:
                store.rollback(excess)
            elif excess < 0:
                raise RollbackError(f"store at {store.num_tokens} tokens is behind the mark {num_tokens}")
    state.num_tokens = num_tokens


def mark_slots(slots: SlotTable, plan: StepPlan) -> dict[int, SlotMark]:
    marks = {}
    for scheduled in plan.sequences:
        slot = slots.slots.get(scheduled.seq_slot)
        if slot is not None and slot.request_id == scheduled.request_id:
            # rejected drafts of the last step are rolled back by prepare(): the mark is where the step starts
            num_tokens = min(slot.state.num_tokens, scheduled.start_position)
            marks[scheduled.seq_slot] = SlotMark(slot.request_id, num_tokens,
                                                 len(slot.prompt_token_ids), len(slot.output_token_ids))
    return marks


def rollback_slots(slots: SlotTable, plan: StepPlan, marks: dict[int, SlotMark]) -> dict[str, str]:
    """Undo a failed attempt; returns {request_id: reason} of sequences that cannot be retried."""
    lost = {}
    for scheduled in plan.sequences:
        slot = slots.slots.get(scheduled.seq_slot)
        if slot is None or slot.request_id != scheduled.request_id:
            continue  # never prepared in the failed attempt
        mark = marks.get(scheduled.seq_slot)
        if scheduled.start_position == 0 or mark is None or mark.request_id != scheduled.request_id:
            del slots.slots[scheduled.seq_slot]  # created by the attempt: the retry creates it again
            continue
        try:
            rollback_state(slot.state, mark.num_tokens)
        except RollbackError as error:
            del slots.slots[scheduled.seq_slot]
            lost[scheduled.request_id] = f"cannot retry this step's {len(scheduled.token_ids)} tokens: {error}"
            continue
        del slot.prompt_token_ids[mark.num_prompt_ids:]
        del slot.output_token_ids[mark.num_output_ids:]
    return lost


class StepRecovery:
    """Runs a step with bounded retries (see the module docstring).

    compute(plan) -> StepResult is the worker's step without block moves;
    `forget_in_flight()` drops the channel's outstanding tickets; `probe()` -> bool: every
    pair is served again (all workers answer). `failover` (failover.ExpertFailover, optional)
    marks a lost worker down and says whether replicas cover it; without it every loss waits.
    `take_stalls()` -> [(endpoint, waited_s)]: expert replies that came late but in time (a worker
    frozen, or killed and restarted within the timeout), logged with the step's requests.
    `free_slots(seq_slots)`: what releases the plan's freed slots when a step is abandoned (the
    worker's, which also drops an in-process drafter's rings; default: the slot table's)."""

    def __init__(self, config: RecoveryConfig, slots: SlotTable, compute: Callable[[StepPlan], Any],
                 forget_in_flight: Callable[[], None], probe: Callable[[], bool], failover: Any = None,
                 take_stalls: Callable[[], list[tuple[str, float]]] = list,
                 free_slots: Callable[[Any], None] | None = None) -> None:
        self.take_stalls = take_stalls
        self.free_slots = free_slots if free_slots is not None else slots.free
        self.config = config
        self.slots = slots
        self.compute = compute
        self.forget_in_flight = forget_in_flight
        self.probe = probe
        self.failover = failover
        self.num_recovered_steps = 0
        self.num_replica_retries = 0
        self.num_waits = 0  # attempts that had to wait for a worker to come back (no live replica)
        self.num_failed_steps = 0

    def run(self, plan: StepPlan) -> StepResult:
        started_s = time.monotonic()
        deadline_s = started_s + self.config.budget_s
        lost: dict[str, str] = {}
        current = plan
        if self.failover is not None:
            self.failover.readmit_due()
        for attempt in range(1, self.config.max_attempts + 1):
            marks = mark_slots(self.slots, current)
            try:
                result = self.compute(current)
            except LOST_EXPERT_ERRORS as error:
                cause = f"{type(error).__name__}: {error}"
                worker = _lost_worker(error)
                self.forget_in_flight()
                lost.update(rollback_slots(self.slots, current, marks))
                log.warning("attention.step_lost_expert", step_id=plan.step_id, attempt=attempt, cause=cause[:300],
                            worker=worker, num_sequences=len(current.sequences),
                            num_unrecoverable=len(lost), request_ids=self._request_ids(current),
                            unrecoverable_request_ids=self._request_ids(current, only=lost))
                current = dataclasses.replace(current, sequences=tuple(
                    s for s in current.sequences if s.request_id not in lost))
                covered = self._replicas_cover(error)  # marks the worker down, last attempt or not
                if attempt == self.config.max_attempts:
                    break
                if covered:
                    self.num_replica_retries += 1
                    log.warning("attention.step_retry_on_replicas", step_id=plan.step_id, attempt=attempt,
                                down_workers=sorted(self.failover.router.down), request_ids=self._request_ids(current))
                    continue
                self.num_waits += 1
                if not self._wait_for_experts(deadline_s):
                    break
                continue
            self._log_stalls(plan)
            if attempt > 1:
                self.num_recovered_steps += 1
                log.warning("attention.step_recovered", step_id=plan.step_id, attempts=attempt,
                            elapsed_s=round(time.monotonic() - started_s, 3), num_unrecoverable=len(lost),
                            request_ids=self._request_ids(plan))
            return _merge(plan, result, lost)
        self.num_failed_steps += 1
        elapsed_s = time.monotonic() - started_s
        reason = (f"expert worker unavailable: {cause[:200]} (gave up after {attempt} attempt(s) in "
                  f"{elapsed_s:.1f}s)")
        log.error("attention.step_abandoned", step_id=plan.step_id, attempts=attempt, elapsed_s=round(elapsed_s, 3),
                  cause=cause[:300], worker=worker, request_ids=self._request_ids(plan))
        self.free_slots(plan.free_seq_slots)
        for scheduled in current.sequences:
            lost.setdefault(scheduled.request_id, reason)
        return _merge(plan, StepResult(step_id=plan.step_id, sequences=()), lost)

    def _log_stalls(self, plan: StepPlan) -> None:
        for endpoint, waited_s in self.take_stalls():  # empty on every ordinary step
            log.warning("attention.expert_reply_stalled", step_id=plan.step_id, endpoint=endpoint,
                        waited_s=round(waited_s, 3), request_ids=self._request_ids(plan))

    def _request_ids(self, plan: StepPlan, only: dict[str, str] | None = None) -> list[str]:
        """The HTTP request ids (X-Request-Id, else the router's sequence ids) of a plan's sequences."""
        ids = []
        for scheduled in plan.sequences:
            if only is not None and scheduled.request_id not in only:
                continue
            slot = self.slots.slots.get(scheduled.seq_slot)
            client_id = scheduled.client_request_id or (slot.client_request_id if slot is not None else None)
            ids.append(client_id or scheduled.request_id)
        return list(dict.fromkeys(ids))[:32]

    def _replicas_cover(self, error: BaseException) -> bool:
        """Mark the worker named by `error` down; True when live replicas serve all its pairs."""
        worker_index = getattr(error, "worker_index", None)
        if self.failover is None or worker_index is None:
            return False
        return self.failover.mark_lost(worker_index)

    def _wait_for_experts(self, deadline_s: float) -> bool:
        while time.monotonic() < deadline_s:
            if self.probe():
                return True
            time.sleep(min(self.config.probe_interval_s, max(0.0, deadline_s - time.monotonic())))
        return False


def build_step_recovery(worker: Any) -> StepRecovery:
    """The StepRecovery of a loaded AttentionWorker (its slots, _compute_step, channel, config)."""
    from moemesh.services.attention.failover import ExpertFailover

    config = worker.config
    channel = worker.channel
    failover = ExpertFailover(worker.dispatcher, worker._zmq_context, config.security,
                              probe_timeout_s=config.recovery.probe_timeout_s,
                              readmit_timeout_s=config.recovery.readmit_timeout_s,
                              readmit_interval_s=config.recovery.readmit_interval_s)

    def forget_in_flight() -> None:
        # Late replies to these tickets are then logged and dropped by ExpertChannel.receive.
        channel._in_flight.clear()
        channel._arrived.clear()
        worker.dispatcher.reset_in_flight()

    def probe() -> bool:
        # A loss tied to no worker marks nobody down: then wait until every worker answers.
        return failover.readmit() if failover.router.down else failover.all_answer()

    def take_stalls() -> list[tuple[str, float]]:
        if not channel.stalls:
            return []
        stalls, channel.stalls = channel.stalls, []
        return stalls

    return StepRecovery(config.recovery, worker.slots, worker._compute_step, forget_in_flight, probe, failover,
                        take_stalls, free_slots=worker._free_slots)


def _lost_worker(error: BaseException) -> str:
    """Which expert worker a lost dispatch names: its channel index and endpoint, as far as known."""
    index = getattr(error, "worker_index", None)
    endpoint = getattr(error, "endpoint", None)
    return " ".join(part for part in (None if index is None else f"#{index}", endpoint) if part) or "unknown"


def _merge(plan: StepPlan, result: StepResult, lost: dict[str, str]) -> StepResult:
    """The plan's sequences in plan order: computed results, or an error for the lost ones."""
    by_id = {s.request_id: s for s in result.sequences}
    for request_id, reason in lost.items():
        by_id[request_id] = SequenceResult(request_id, (), error=reason[:300])
    return StepResult(step_id=plan.step_id, sequences=tuple(by_id[s.request_id] for s in plan.sequences),
                      routing=result.routing, draft_s=result.draft_s)
