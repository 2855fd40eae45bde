"""The router's side of speculative decoding (docs/design.md §2 step 7, §5): ask the drafter, relay drafts.

Per engine step, around the attention worker's step:

    plan = drafts.decorate(plan)            # send_features on every sequence; sampled drafts carry
                                            # the sparse distributions they were drawn from
    ... attention worker verifies drafts, sends TargetFeatures to the drafter, answers ...
    drafts.record(events)                   # acceptance by draft position (metrics)
    await drafts.after_step(scheduler, events)
        # one DraftRequest for every running request in decode (its next step computes one
        # known token, the seed): DraftTokens -> scheduler.set_draft_tokens before schedule()

Seeds: the drafter draws sampled drafts from stream (seed, DRAFT, position). The request's own
seed is used when it has one (so a seeded request is reproducible end to end); otherwise the
router picks one per request. Draft noise is independent of the verifier's either way (its own
purpose), which is what keeps rejection sampling lossless.

Nothing silent: until the drafter reports Ready, `status()` says "starting"; a failed
DraftRequest (timeout, error reply) or a drafter that stopped beating turns speculation off,
logs `router.drafter_failed` (or `router.drafter_silent`) and makes `status()` "down: <reason>",
shown in /health's details without turning /health to 503 (serving goes on without drafts).
Every response's usage.speculative says whether its request was verified with drafts.

Coming back: a drafter process that reports a new Ready to the supervisor (a restart: another
pid, or a later Ready) and beats turns speculation back on (`router.drafter_recovered`). Its
feature rings start empty and fill from the next steps' committed positions, so acceptance
recovers over a few steps; outputs never depend on it (verification is lossless). Drafts that
were already handed to the scheduler before a failure keep their distributions and are
verified normally, so a failure never leaves a sampled draft without its q.
Width (services/router/spec_policy.py): with `width_policy` DRAFTER the router verifies what the
drafter proposed (fixed mode; adaptive mode's confidence rule). With COST (adaptive mode's
cost-aware part, docs/speculation.md §2.4) it learns from the engine's own step timings what a cycle costs
(`observe_step`, called by the engine after every attention step) and, per cycle, skips the
DraftRequest when drafting is not expected to pay, and otherwise cuts each request's proposal to
the widths that maximise the batch's expected committed tokens per second.
Plain Python, no torch (the router never imports it).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from moemesh.common.wire.messages import (
    DraftRequest, DraftSlot, DraftTokens, ErrorReply, ServiceRole, ServiceState, StepPlan,
)
from moemesh.services.router.spec_cost import StepCostModel
from moemesh.services.router.spec_policy import CostAwareWidths, CostPolicyConfig, WidthPolicyKind

log = structlog.get_logger("router")

@dataclass(frozen=True)
class DraftConfig:
    """draft_name: the draft worker's service name (supervisor records); max_draft_tokens: drafts
    asked per request and step (the drafter's block size; its width policy may return fewer);
    timeout_s: bound on one DraftRequest round trip (the engine loop waits for it, so a dead
    drafter costs at most this once); max_heartbeat_silence_s: a drafter silent for longer
    (no Ready, heartbeat or reply) is treated as gone before a request has to time out;
    width_policy: DRAFTER keeps the drafter's widths, COST adds the cost-aware cut (spec_policy.py);
    max_start_s: a drafter with no Ready this long after the router started is reported down
    instead of starting (one that crashed while loading never beats, so nothing else would tell);
    in_attention: the attention worker drafts right after each step (`[draft] placement = "attention"`):
    the plan asks for drafts (`draft_after`) and they come back in the StepResult, no DraftRequest."""

    draft_name: str = "draft"
    max_draft_tokens: int = 5
    timeout_s: float = 10.0
    max_heartbeat_silence_s: float = 5.0
    width_policy: WidthPolicyKind = WidthPolicyKind.DRAFTER
    cost_policy: CostPolicyConfig = CostPolicyConfig()
    max_start_s: float = 600.0
    in_attention: bool = False  # the drafter runs in the attention worker's process: drafts come with the step

    def __post_init__(self) -> None:
        if not isinstance(self.width_policy, WidthPolicyKind):
            raise ValueError(f"width_policy must be a WidthPolicyKind, got {self.width_policy!r}")
        if self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        for name in ("timeout_s", "max_heartbeat_silence_s", "max_start_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


ProposeFn = Callable[[DraftRequest], Awaitable[Any]]


class DraftCoordinator:
    """propose: sends one DraftRequest and returns the reply (DraftTokens or ErrorReply; raises
    on timeout). supervisor: the router's Supervisor (None: the drafter counts as ready).
    cost: the cost model of the COST width policy (None: learned online from the engine's steps;
    a spec_cost.FixedStepCost makes the policy deterministic)."""

    def __init__(self, config: DraftConfig, propose: ProposeFn, supervisor: Any = None,
                 clock: Callable[[], float] = time.monotonic, cost: StepCostModel | None = None) -> None:
        self.config = config
        self._cost = cost
        self.widths = (CostAwareWidths(config.cost_policy, cost)
                       if config.width_policy is WidthPolicyKind.COST else None)
        self._propose = propose
        self._supervisor = supervisor
        self._clock = clock
        self._created_s = clock()
        self._failure: str | None = None
        self._failed_ready: Any = None  # the drafter's Ready when a request failed: only a newer one revives it
        self._failed_silent = False  # failed by heartbeat silence: fresh heartbeats revive it
        self.num_failures = 0
        self.num_recoveries = 0
        self.round_trip_s_total = 0.0  # DraftRequest sent .. reply, summed (benchmarks: where step time goes)
        self._draft_seeds: dict[str, int] = {}
        self._supports: dict[str, tuple[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], ...]]] = {}
        self._known_ids: set[str] = set()
        self._step_ids = 0
        self.num_draft_requests = 0
        self.draft_by_position = [0] * config.max_draft_tokens
        self.accepted_by_position = [0] * config.max_draft_tokens

    # -- health ----------------------------------------------------------------------------
    def status(self) -> str:
        """"ok", "starting: ...", or "down: <why>" (shown in /health's details)."""
        self._maybe_recover()
        if self._failure is not None:
            return f"down: {self._failure}; serving without speculation"
        supervisor = self._supervisor
        if supervisor is None:
            return "ok"
        if self.config.in_attention:
            return _in_attention_status(supervisor)
        name = self.config.draft_name
        beat = supervisor.heartbeats.get(name)
        if beat is not None and beat.state is ServiceState.STOPPED:
            return "down: stopped; serving without speculation"
        if name in supervisor.ready or (beat is not None and beat.state is ServiceState.READY):
            silence_s = self._silence_s()
            if silence_s is not None and silence_s > self.config.max_heartbeat_silence_s:
                self._fail(f"no heartbeat for {silence_s:.1f} s", silent=True)
                return f"down: {self._failure}; serving without speculation"
            return "ok"
        waited_s = self._clock() - self._created_s
        if waited_s > self.config.max_start_s:  # it died while loading (serve says so) or never started
            return (f"down: no Ready from the draft worker within {self.config.max_start_s:.0f} s; "
                    "serving without speculation")
        return "starting: not ready yet (serving without speculation meanwhile)"

    @property
    def active(self) -> bool:
        return self.status() == "ok"

    def _silence_s(self) -> float | None:
        seen_s = getattr(self._supervisor, "last_seen_s", {}).get(self.config.draft_name)
        return None if seen_s is None else self._clock() - seen_s

    def _fail(self, reason: str, silent: bool = False) -> None:
        """Speculation off until the drafter is back (see _maybe_recover). Stored draft
        distributions stay: drafts already given to the scheduler are verified against them."""
        self._failure = reason
        self._failed_silent = silent
        self.num_failures += 1
        supervisor = self._supervisor
        self._failed_ready = supervisor.ready.get(self.config.draft_name) if supervisor is not None else None
        log.error("router.drafter_silent" if silent else "router.drafter_failed", reason=reason,
                  action="serving continues without speculation")

    def _maybe_recover(self) -> None:
        """The drafter is back when it beats again and, after a failed request, has reported a
        Ready other than the one it failed with (a restarted process: its sockets and rings are new)."""
        supervisor = self._supervisor
        if self._failure is None or supervisor is None:
            return
        ready = supervisor.ready.get(self.config.draft_name)
        if ready is None or (ready is self._failed_ready and not self._failed_silent):
            return
        silence_s = self._silence_s()
        if silence_s is None or silence_s > self.config.max_heartbeat_silence_s:
            return
        log.info("router.drafter_recovered", draft=self.config.draft_name, pid=ready.pid, after=self._failure,
                 action="speculation resumes")
        self._failure = None
        self._failed_ready = None
        self.num_recoveries += 1

    # -- the plan --------------------------------------------------------------------------
    def decorate(self, plan: StepPlan, scheduler: Any = None) -> StepPlan:
        """The plan as sent: features wanted for every sequence while the drafter is up (except
        while the cost policy runs plain steps far from its next probe: CostAwareWidths.wants_features),
        and each sampled sequence's drafts paired with their distributions (cut to the drafts the
        scheduler kept). With the drafter in the attention worker (`in_attention`; scheduler given),
        every sequence that samples this step also asks for its next block (`draft_after`, `draft_seed`)."""
        if not plan.sequences:
            return plan
        active = self.active
        if not active and not self._supports:
            return plan
        # the cost policy in a long run of plain steps wants no features until shortly before its probe
        send_features = active and (self.widths is None or self.widths.wants_features())
        asks = self._next_draft_asks(plan, scheduler) if active and self.config.in_attention else {}
        sequences = []
        for seq in plan.sequences:
            ids, probs = self._supports.pop(seq.request_id, ((), ()))
            num_drafts = len(seq.draft_token_ids)
            if ids and num_drafts:
                seq = dataclasses.replace(seq, draft_support_token_ids=ids[:num_drafts],
                                          draft_support_probs=probs[:num_drafts])
            if send_features:
                seq = dataclasses.replace(seq, send_features=True)
            if active:
                self._known_ids.add(seq.request_id)
            if seq.request_id in asks:
                seq = dataclasses.replace(seq, draft_after=self.config.max_draft_tokens,
                                          draft_seed=asks[seq.request_id])
            sequences.append(seq)
        return dataclasses.replace(plan, sequences=tuple(sequences))

    def _next_draft_asks(self, plan: StepPlan, scheduler: Any) -> dict[str, int | None]:
        """request id -> its draft seed (None: greedy) for the sequences that sample this step, unless the
        cost policy expects a plain next step to pay better. The caps that depend on the step's outcome
        (max_tokens, the context length) are applied in after_step."""
        if scheduler is None:
            return {}
        sampling = [seq for seq in plan.sequences if seq.do_sample]
        if not sampling:
            return {}
        if self.widths is not None and not self.widths.should_draft(len(plan.sequences), len(sampling),
                                                                    [seq.request_id for seq in sampling]):
            return {}
        asks = {}
        for seq in sampling:
            request = scheduler.get_request(seq.request_id)
            if request is None or request.is_finished:
                continue
            params = request.sampling_params
            asks[seq.request_id] = None if params.is_greedy else self._draft_seed(request)
        return asks

    def _draft_seed(self, request: Any) -> int:
        seed = request.sampling_params.seed
        return seed if seed is not None else self._draft_seeds.setdefault(request.request_id, secrets.randbits(63))

    # -- after a step ----------------------------------------------------------------------
    def record(self, events: Iterable[Any]) -> None:
        """Acceptance by draft position from the step's RequestEvents (and the cost policy's calibration)."""
        events = list(events)
        if self.widths is not None:
            self.widths.observe_acceptance(events)
        for event in events:
            for position in range(min(event.num_draft_tokens, len(self.draft_by_position))):
                self.draft_by_position[position] += 1
                if position < event.num_accepted_drafts:
                    self.accepted_by_position[position] += 1

    def observe_step(self, output: Any, attention_s: float, draft_s: float = 0.0) -> None:
        """The engine's timing of one attention step (its SchedulerOutput): the cost policy learns from it.
        draft_s: the part of it the attention worker spent drafting (in_attention), counted as drafting."""
        if self.widths is not None:
            self.widths.observe_step(output.scheduled, max(0.0, attention_s - draft_s), time.perf_counter())

    async def after_step(self, scheduler: Any, events: Iterable[Any], next_drafts: Mapping[str, Any] | None = None,
                         draft_s: float = 0.0) -> None:
        """Ask for the next block of every running request in decode; set_draft_tokens. With the drafter
        in the attention worker, the blocks came with the step (`next_drafts` by request id, drafted in
        `draft_s` seconds) and nothing is sent."""
        if not self.active:
            return
        events = list(events)
        slots = [slot for slot in (self._slot(scheduler, event) for event in events) if slot is not None]
        num_sequences = sum(1 for event in events if not event.is_finished)
        if self.config.in_attention:
            self._finished_ids(scheduler)  # forgets their seeds and distributions; their rings go with their slots
            if next_drafts:
                self.round_trip_s_total += draft_s
                self.num_draft_requests += 1
                self._apply(scheduler, slots, [next_drafts[s.request_id] for s in slots if s.request_id in next_drafts],
                            num_sequences, draft_s)
            return
        if slots and self.widths is not None and not self.widths.should_draft(num_sequences, len(slots),
                                                                               [s.request_id for s in slots]):
            return  # a plain step pays better; finished requests are reported with the next request
        finished = self._finished_ids(scheduler)
        if not slots and not finished:
            return
        self._step_ids += 1
        request = DraftRequest(step_id=self._step_ids, slots=tuple(slots), finished_request_ids=tuple(finished))
        started_s = time.perf_counter()
        try:
            reply = await self._propose(request)
        except Exception as error:  # a timeout or a broken socket: the drafter is gone
            self._fail(f"draft request failed: {type(error).__name__}: {str(error)[:200]}")
            return
        round_trip_s = time.perf_counter() - started_s
        self.round_trip_s_total += round_trip_s
        self.num_draft_requests += 1
        match reply:
            case DraftTokens():
                self._apply(scheduler, slots, reply.proposals, num_sequences, round_trip_s)
            case ErrorReply(code=code, message=message):
                self._fail(f"drafter refused: {code.value}: {message[:200]}")
            case _:
                self._fail(f"drafter answered {type(reply).__name__} to a draft_request")

    def _apply(self, scheduler: Any, slots: list[DraftSlot], proposals: Iterable[Any], num_sequences: int,
               draft_s: float) -> None:
        """Hand each proposal, cut to what its slot allows and to the width policy's choice, to the scheduler."""
        asked = {slot.request_id: slot.num_draft_tokens for slot in slots}  # <= the block size
        proposals = [p for p in proposals if p.token_ids and p.request_id in asked
                     and scheduler.get_request(p.request_id) is not None]
        caps = [min(len(p.token_ids), asked[p.request_id]) for p in proposals]  # never more than asked
        widths = caps
        if self.widths is not None and slots:
            self.widths.observe_draft(len(slots), draft_s)
            widths = self.widths.choose_widths([p.confidences[:cap] for p, cap in zip(proposals, caps)],
                                               num_sequences, [p.request_id for p in proposals])
        for proposal, width in zip(proposals, widths):
            if width < 1:
                continue
            scheduler.set_draft_tokens(proposal.request_id, list(proposal.token_ids[:width]))
            if proposal.support_token_ids:
                self._supports[proposal.request_id] = (proposal.support_token_ids, proposal.support_probs)

    def _slot(self, scheduler: Any, event: Any) -> DraftSlot | None:
        if event.is_finished:
            return None
        request = scheduler.get_request(event.request_id)
        if request is None or request.is_finished or request.num_computed_tokens != request.num_tokens - 1:
            return None  # gone, or still in prefill
        params = request.sampling_params
        num_left = min(params.max_tokens - request.num_output_tokens,
                       scheduler.config.max_model_len - request.num_tokens)
        num_drafts = min(self.config.max_draft_tokens, num_left - 1)
        if num_drafts < 1:
            return None
        seed_position = request.num_tokens - 1
        slot = DraftSlot(request_id=request.request_id, num_draft_tokens=num_drafts,
                         last_token_ids=(request.token_id_at(seed_position),), start_position=seed_position)
        if params.is_greedy:
            return slot
        return dataclasses.replace(slot, temperature=params.temperature, seed=self._draft_seed(request),
                                   first_output_position=request.num_output_tokens)

    def _finished_ids(self, scheduler: Any) -> list[str]:
        finished = []
        for request_id in list(self._known_ids):
            request = scheduler.get_request(request_id)
            if request is None or request.is_finished:
                finished.append(request_id)
                self._known_ids.discard(request_id)
                self._draft_seeds.pop(request_id, None)
                self._supports.pop(request_id, None)
                if self.widths is not None:
                    self.widths.forget(request_id)
        return finished

    def forget_measurements(self) -> None:
        """After the router's start-time warm-up (warm_up.py): the acceptance counters and the cost policy's
        measurements start afresh, since synthetic drafts and first-use step times say nothing of served
        traffic. The per-request bookkeeping stays: the finished synthetic requests are still reported to
        the drafter, whose rings they free. Failures and recoveries stay counted: they happened."""
        self.round_trip_s_total = 0.0
        self.num_draft_requests = 0
        self.draft_by_position = [0] * self.config.max_draft_tokens
        self.accepted_by_position = [0] * self.config.max_draft_tokens
        if self.widths is not None:
            self.widths = CostAwareWidths(self.config.cost_policy, self._cost)

    # -- counters --------------------------------------------------------------------------
    def stats(self) -> dict:
        """EngineClient.stats() keys: acceptance by draft position (cumulative)."""
        return {"spec_draft_by_position": list(self.draft_by_position),
                "spec_accepted_by_position": list(self.accepted_by_position),
                "spec_num_draft_requests": self.num_draft_requests,
                "spec_draft_round_trip_s_total": self.round_trip_s_total,
                "spec_drafter_failures": self.num_failures,
                "spec_drafter_recoveries": self.num_recoveries,
                "spec_width_policy": self.config.width_policy.value,
                **(self.widths.stats() if self.widths is not None else {})}


def _in_attention_status(supervisor: Any) -> str:
    """The drafter inside the attention workers: "starting" until one reported Ready, "down" when a
    worker's drafter failed to load (its Ready's detail), else "ok"."""
    workers = [ready for ready in supervisor.ready.values() if ready.role is ServiceRole.ATTENTION]
    if not workers:
        return "starting: no attention worker ready yet (the drafter loads inside it)"
    failed = [ready for ready in workers if ready.detail.startswith("drafter failed")]
    if failed:
        return f"down: {failed[0].name}: {failed[0].detail}; serving without speculation"
    return "ok"
