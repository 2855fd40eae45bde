"""The router's draft coordinator (services/router/engine_drafts.py) with a real Scheduler; no torch."""

from __future__ import annotations

import asyncio

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import DraftProposal, DraftTokens, Ready, ServiceRole, StepPlan
from moemesh.services.router.engine_drafts import DraftConfig, DraftCoordinator
from moemesh.services.router.engine_plan import PlanTranslator
from moemesh.services.router.scheduler import Request, Scheduler, SchedulerConfig, SequenceResult


class Drafter:
    """Answers every slot with fixed drafts (sampled slots with a sparse distribution)."""

    def __init__(self, fail: bool = False) -> None:
        self.requests = []
        self.fail = fail

    async def __call__(self, request):
        self.requests.append(request)
        if self.fail:
            raise TimeoutError("no answer")
        proposals = []
        for slot in request.slots:
            ids = tuple(range(50, 50 + slot.num_draft_tokens))
            support = ((ids[0], 7),) * len(ids) if slot.temperature > 0 else ()
            probs = ((0.75, 0.25),) * len(ids) if slot.temperature > 0 else ()
            proposals.append(DraftProposal(slot.request_id, ids, (0.5,) * len(ids), (0.9,) * len(ids),
                                           tuple((i, 7) for i in ids) if support else (), probs))
        return DraftTokens(step_id=request.step_id, proposals=tuple(proposals))


def _prefilled(scheduler):
    scheduler.add_request(Request("g", (1, 2, 3), SamplingParams(max_tokens=4)))
    scheduler.add_request(Request("s", (1, 2, 3), SamplingParams(max_tokens=20, temperature=1.0, seed=5)))
    output = scheduler.schedule()
    return scheduler.update(output, {"g": SequenceResult((9,)), "s": SequenceResult((8,))})


def test_decode_requests_get_drafts_and_sampled_ones_their_distributions():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=512))
    drafter = Drafter()
    drafts = DraftCoordinator(DraftConfig(max_draft_tokens=5), drafter)
    asyncio.run(drafts.after_step(scheduler, _prefilled(scheduler)))
    slots = {slot.request_id: slot for slot in drafter.requests[0].slots}
    assert slots["g"].num_draft_tokens == 2  # max_tokens 4, one output so far: 2 drafts + bonus
    assert slots["g"].last_token_ids == (9,) and slots["g"].start_position == 3 and slots["g"].seed is None
    assert slots["s"].num_draft_tokens == 5 and slots["s"].seed == 5 and slots["s"].first_output_position == 1
    output = scheduler.schedule()
    plan = drafts.decorate(PlanTranslator().plans_for(output)[-1])
    by_id = {seq.request_id: seq for seq in plan.sequences}
    assert by_id["g"].draft_token_ids == (50, 51) and by_id["g"].draft_support_token_ids == ()
    assert by_id["s"].draft_token_ids == (50, 51, 52, 53, 54)
    assert by_id["s"].draft_support_token_ids[0] == (50, 7) and by_id["s"].draft_support_probs[4] == (0.75, 0.25)
    assert all(seq.send_features for seq in plan.sequences)
    events = scheduler.update(output, {"g": SequenceResult((50, 51, 99), num_accepted_drafts=2),
                                       "s": SequenceResult((77,), num_accepted_drafts=0)})
    drafts.record(events)
    stats = drafts.stats()
    assert stats["spec_draft_by_position"] == [2, 2, 1, 1, 1] and stats["spec_accepted_by_position"] == [1, 1, 0, 0, 0]
    assert stats["spec_num_draft_requests"] == 1 and stats["spec_draft_round_trip_s_total"] > 0
    asyncio.run(drafts.after_step(scheduler, events))
    assert drafter.requests[-1].finished_request_ids == ("g",)  # g reached max_tokens: its ring is dropped


def test_a_failing_drafter_turns_speculation_off_and_says_so():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=512))
    drafter = Drafter(fail=True)
    drafts = DraftCoordinator(DraftConfig(), drafter)
    assert drafts.status() == "ok"
    asyncio.run(drafts.after_step(scheduler, _prefilled(scheduler)))
    assert drafts.status().startswith("down: draft request failed: TimeoutError")
    plan = StepPlan(step_id=1, sequences=())
    assert drafts.decorate(plan) is plan
    asyncio.run(drafts.after_step(scheduler, []))
    assert len(drafter.requests) == 1  # never asked again
    assert not scheduler.get_request("g").draft_token_ids


class Records:
    """What the coordinator reads of the router's Supervisor: Ready per name, heartbeats, last seen."""

    def __init__(self, clock) -> None:
        self.ready, self.heartbeats, self.last_seen_s = {}, {}, {}
        self.clock = clock

    def report_ready(self, name: str, pid: int) -> None:
        self.ready[name] = Ready(name=name, role=ServiceRole.DRAFT, pid=pid, endpoint="ipc://draft")
        self.last_seen_s[name] = self.clock.now_s

    def beat(self, name: str) -> None:
        self.last_seen_s[name] = self.clock.now_s


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _coordinator(drafter, clock):
    records = Records(clock)
    drafts = DraftCoordinator(DraftConfig(max_heartbeat_silence_s=3.0), drafter, records, clock=clock)
    return drafts, records


def test_a_silent_drafter_is_down_until_it_beats_again():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=512))
    clock, drafter = Clock(), Drafter()
    drafts, records = _coordinator(drafter, clock)
    assert drafts.status().startswith("starting")
    records.report_ready("draft", pid=10)
    assert drafts.status() == "ok"
    clock.now_s += 4.0  # no heartbeat for longer than the bound
    assert drafts.status().startswith("down: no heartbeat for 4.0 s")
    asyncio.run(drafts.after_step(scheduler, _prefilled(scheduler)))
    assert drafter.requests == []  # not asked while down
    records.beat("draft")
    assert drafts.status() == "ok" and drafts.stats()["spec_drafter_recoveries"] == 1


def test_after_a_failed_request_only_a_restarted_drafter_is_used_again():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=512))
    clock, drafter = Clock(), Drafter(fail=True)
    drafts, records = _coordinator(drafter, clock)
    records.report_ready("draft", pid=10)
    asyncio.run(drafts.after_step(scheduler, _prefilled(scheduler)))
    assert drafts.status().startswith("down: draft request failed")
    records.beat("draft")  # the same process still beating: it stays off (its state is unknown)
    assert drafts.status().startswith("down")
    drafter.fail = False
    records.report_ready("draft", pid=11)  # restarted
    assert drafts.status() == "ok"
    events = scheduler.update(scheduler.schedule(), {"g": SequenceResult((5,)), "s": SequenceResult((6,))})
    asyncio.run(drafts.after_step(scheduler, events))
    assert len(drafter.requests) == 2 and scheduler.get_request("s").draft_token_ids


def test_drafts_handed_out_before_a_failure_keep_their_distributions():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=512))
    clock, drafter = Clock(), Drafter()
    drafts, records = _coordinator(drafter, clock)
    records.report_ready("draft", pid=10)
    asyncio.run(drafts.after_step(scheduler, _prefilled(scheduler)))
    clock.now_s += 10.0  # the drafter dies after answering
    assert drafts.status().startswith("down")
    plan = drafts.decorate(PlanTranslator().plans_for(scheduler.schedule())[-1])
    sampled = {seq.request_id: seq for seq in plan.sequences}["s"]
    assert sampled.draft_token_ids == (50, 51, 52, 53, 54)
    assert len(sampled.draft_support_token_ids) == 5  # verifiable: q travels with its drafts
    assert not any(seq.send_features for seq in plan.sequences)  # nobody to send features to


def test_a_drafter_that_never_reports_ready_is_down_after_the_start_bound():
    clock, drafter = Clock(), Drafter()
    records = Records(clock)
    drafts = DraftCoordinator(DraftConfig(max_start_s=60.0), drafter, records, clock=clock)
    clock.now_s += 59.0
    assert drafts.status().startswith("starting: not ready yet")
    clock.now_s += 2.0  # it crashed while loading: no Ready, no heartbeat ever
    assert drafts.status() == ("down: no Ready from the draft worker within 60 s; serving without speculation")
    assert not drafts.active
    records.report_ready("draft", pid=11)  # a slow load that finally made it
    assert drafts.status() == "ok"
