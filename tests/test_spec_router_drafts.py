"""The router's draft coordinator (services/router/engine_drafts.py) with a real Scheduler; no torch."""

from __future__ import annotations

import asyncio

from common.sampling_params import SamplingParams
from common.wire.messages import DraftProposal, DraftTokens, StepPlan
from services.router.engine_drafts import DraftConfig, DraftCoordinator
from services.router.engine_plan import PlanTranslator
from services.router.scheduler import Request, Scheduler, SchedulerConfig, SequenceResult


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
    assert drafts.stats() == {"spec_draft_by_position": [2, 2, 1, 1, 1], "spec_accepted_by_position": [1, 1, 0, 0, 0]}
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
