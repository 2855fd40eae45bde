"""Draft tokens: verified in the normal step, counted in budget and blocks, rejected ones freed."""

from __future__ import annotations

import random

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.scheduler import FinishReason, Request, Scheduler, SchedulerConfig, SequenceResult
from sim_engine_support import SimulatedEngine, oracle_drafter


def prompt(seed: str, count: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1000) for _ in range(count))


def test_drafts_count_against_budget_and_are_truncated_to_fit():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, max_model_len=1024, max_num_batched_tokens=8))
    for request_id in ("a", "b"):
        scheduler.add_request(Request(request_id, (1, 2, 3), SamplingParams(max_tokens=50, ignore_eos=True)))
    plan = scheduler.schedule()
    scheduler.update(plan, {"a": SequenceResult((4,)), "b": SequenceResult((4,))})
    scheduler.set_draft_tokens("a", [5, 6, 7, 8, 9])
    scheduler.set_draft_tokens("b", [5, 6, 7, 8, 9])
    plan = scheduler.schedule()
    by_id = {seq.request_id: seq for seq in plan.scheduled}
    assert by_id["a"].token_ids == (4, 5, 6, 7, 8, 9) and by_id["a"].draft_token_ids == (5, 6, 7, 8, 9)
    assert by_id["b"].token_ids == (4, 5) and by_id["b"].draft_token_ids == (5,)  # the budget's remainder
    assert plan.num_scheduled_tokens == 8 and plan.num_draft_tokens == 6


def test_draft_blocks_are_allocated_and_rejected_ones_freed():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=4, max_model_len=512))
    scheduler.add_request(Request("r", tuple(range(126)), SamplingParams(max_tokens=50, ignore_eos=True)))
    plan = scheduler.schedule()
    scheduler.update(plan, {"r": SequenceResult((7,))})
    assert scheduler.stats().num_gpu_blocks_used == 1
    scheduler.set_draft_tokens("r", [10, 11, 12, 13])  # positions 127..130 cross into block 2
    plan = scheduler.schedule()
    assert len(plan.scheduled[0].block_ids) == 2 and scheduler.stats().num_gpu_blocks_used == 2
    events = scheduler.update(plan, {"r": SequenceResult((99,), num_accepted_drafts=0)})
    assert events[0].new_token_ids == (99,) and events[0].num_draft_tokens == 4 and events[0].num_accepted_drafts == 0
    request = scheduler.get_request("r")
    assert request.num_computed_tokens == 127 and request.num_tokens == 128 and not request.draft_token_ids
    assert scheduler.stats().num_gpu_blocks_used == 1  # the rejected drafts' block went back
    # A rejected draft completed block 0 during the step; it must not be keyed.
    assert scheduler.kv.gpu.num_cached_blocks == 0


def test_accepted_drafts_match_plain_decoding_in_fewer_steps():
    outputs = {}
    steps = {}
    for name, drafter in (("plain", None), ("spec", oracle_drafter(4)), ("half", oracle_drafter(4, num_wrong_at=2))):
        engine = SimulatedEngine(Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=1024)), drafter=drafter)
        engine.add(Request("r", prompt("p", 200), SamplingParams(max_tokens=60, ignore_eos=True)))
        steps[name] = engine.run_until_done(max_steps=200)
        outputs[name] = engine.requests["r"].output_token_ids
        accepted = [event.num_accepted_drafts for event in engine.events["r"]]
        if name == "half":
            assert max(accepted) == 2
    assert outputs["plain"] == outputs["spec"] == outputs["half"] and len(outputs["plain"]) == 60
    assert steps["spec"] < steps["half"] < steps["plain"]


def test_drafts_never_run_past_max_tokens():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=4, max_model_len=512))
    scheduler.add_request(Request("r", (1, 2), SamplingParams(max_tokens=3, ignore_eos=True)))
    plan = scheduler.schedule()
    scheduler.update(plan, {"r": SequenceResult((3,))})
    scheduler.set_draft_tokens("r", [4, 5, 6, 7, 8])
    plan = scheduler.schedule()
    assert plan.scheduled[0].draft_token_ids == (4,)  # 2 outputs left: 1 draft + 1 bonus
    events = scheduler.update(plan, {"r": SequenceResult((4, 9), num_accepted_drafts=1)})
    assert events[0].new_token_ids == (4, 9) and events[0].finish_reason is FinishReason.LENGTH


def test_stop_inside_accepted_drafts_drops_the_rest():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=4, max_model_len=512))
    scheduler.add_request(Request("r", (1, 2), SamplingParams(max_tokens=30), eos_token_ids=(6,)))
    plan = scheduler.schedule()
    scheduler.update(plan, {"r": SequenceResult((3,))})
    scheduler.set_draft_tokens("r", [5, 6, 7])
    plan = scheduler.schedule()
    events = scheduler.update(plan, {"r": SequenceResult((5, 6, 7, 8), num_accepted_drafts=3)})
    assert events[0].new_token_ids == (5, 6) and events[0].finish_reason is FinishReason.STOP
    assert scheduler.stats().num_gpu_blocks_used == 0


def test_inconsistent_verification_result_is_an_error():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=4, max_model_len=512))
    scheduler.add_request(Request("r", (1, 2), SamplingParams(max_tokens=30)))
    plan = scheduler.schedule()
    scheduler.update(plan, {"r": SequenceResult((3,))})
    scheduler.set_draft_tokens("r", [5, 6])
    plan = scheduler.schedule()
    events = scheduler.update(plan, {"r": SequenceResult((5, 9, 1), num_accepted_drafts=2)})
    assert events[0].finish_reason is FinishReason.ERROR and "differ" in events[0].error
    assert scheduler.stats().num_gpu_blocks_used == 0
