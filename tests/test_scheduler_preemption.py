"""Preemption when GPU blocks run out: swap to the CPU tier, or recompute; resumption positions."""

from __future__ import annotations

import random

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.scheduler import (
    FinishReason,
    Request,
    RequestStatus,
    RestoreReason,
    Scheduler,
    SchedulerConfig,
)
from sim_engine_support import SimulatedEngine


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int) -> Request:
    rng = random.Random(request_id)
    prompt = tuple(rng.randrange(1000) for _ in range(num_prompt_tokens))
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def two_request_engine(
    num_cpu_blocks: int, enable_prefix_caching: bool = True, max_tokens_a: int = 200
) -> SimulatedEngine:
    """GPU pool of 4 blocks; A (256-token prompt) and B (250) fill it after one step, so A's
    first decode needs a fifth block and B, the later admission, is the victim."""
    config = SchedulerConfig(
        num_gpu_blocks=4,
        max_model_len=512,
        num_cpu_blocks=num_cpu_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )
    engine = SimulatedEngine(Scheduler(config))
    engine.add(make_request("A", 256, max_tokens=max_tokens_a))
    engine.add(make_request("B", 250, max_tokens=20))
    first = engine.step()
    assert {seq.request_id: len(seq.block_ids) for seq in first.plan.scheduled} == {"A": 2, "B": 2}
    return engine


def run_and_check_outputs(engine: SimulatedEngine, plans: list) -> None:
    engine.run_until_done(max_steps=5000, on_step=lambda record: plans.append(record.plan))
    for request in engine.requests.values():
        assert request.finish_reason is FinishReason.LENGTH
        assert request.output_token_ids == engine.expected_output(request, request.sampling_params.max_tokens)
    stats = engine.scheduler.stats()
    assert stats.num_gpu_blocks_used == 0 and stats.num_cpu_blocks_used == 0
    assert stats.num_free_state_slots == engine.scheduler.config.max_num_running_seqs


def find_preemption(engine: SimulatedEngine, max_steps: int = 200):
    for _ in range(max_steps):
        record = engine.step()
        if record.plan.preempted_request_ids:
            return record.plan
    raise AssertionError("no preemption happened")


def test_preemption_by_swap_and_resumption_at_block_boundary():
    engine = two_request_engine(num_cpu_blocks=4)
    preempting = find_preemption(engine)
    victim = engine.requests["B"]
    assert preempting.preempted_request_ids == ("B",)
    assert victim.status is RequestStatus.PREEMPTED_SWAPPED
    # B had 250 + its decoded tokens computed: only the one full block goes to the CPU tier.
    assert len(preempting.swap_out) == 1 and victim.num_computed_tokens == 128
    assert engine.scheduler.stats().num_cpu_blocks_used == 1
    assert engine.scheduler.stats().counters.num_preemptions_swap == 1
    num_outputs_at_preemption = victim.num_output_tokens
    engine.add(make_request("C", 10, max_tokens=3))  # must not overtake the swapped request
    plans = []
    run_and_check_outputs(engine, plans)
    resume = next(plan for plan in plans if plan.swap_in)
    restore = resume.state_restores[0]
    assert (restore.request_id, restore.reason, restore.num_restored_tokens) == ("B", RestoreReason.SWAP_IN, 128)
    seq = next(seq for seq in resume.scheduled if seq.request_id == "B")
    assert seq.is_new_sequence and seq.start_position == 128
    assert seq.block_ids[0] == resume.swap_in[0][1]
    # The recomputed tail covers the rest of the prompt and the outputs made before preemption.
    assert seq.num_tokens == 250 + num_outputs_at_preemption - 128
    first_c = next(index for index, plan in enumerate(plans) if any(s.request_id == "C" for s in plan.scheduled))
    assert first_c >= plans.index(resume)
    # The swapped-in block is keyed again: a request with B's prompt reuses it.
    again = Request("B_again", victim.prompt_token_ids, SamplingParams(max_tokens=1))
    engine.add(again)
    engine.run_until_done(max_steps=10)
    assert again.num_cached_prefix_tokens == 128


def test_preemption_by_recompute_without_cpu_room():
    engine = two_request_engine(num_cpu_blocks=0, enable_prefix_caching=False)
    preempting = find_preemption(engine)
    victim = engine.requests["B"]
    assert preempting.preempted_request_ids == ("B",) and not preempting.swap_out
    assert victim.status is RequestStatus.PREEMPTED_RECOMPUTE and victim.num_computed_tokens == 0
    assert engine.scheduler.stats().counters.num_preemptions_recompute == 1
    assert engine.scheduler.stats().num_waiting_prompt_tokens == victim.num_tokens
    num_known = victim.num_tokens
    plans = []
    run_and_check_outputs(engine, plans)
    restart = next(s for plan in plans for s in plan.scheduled if s.request_id == "B")
    assert restart.is_new_sequence and restart.start_position == 0
    # Prompt and outputs so far are recomputed together, output ids included.
    assert restart.token_ids[:num_known] == tuple(engine.requests["B"].token_ids_between(0, num_known))


def test_recompute_restarts_from_prefix_cache_when_blocks_stayed_cached():
    # A grows to 3 blocks only, so B's keyed first block is never evicted while B waits.
    engine = two_request_engine(num_cpu_blocks=0, enable_prefix_caching=True, max_tokens_a=100)
    find_preemption(engine)
    assert engine.requests["B"].status is RequestStatus.PREEMPTED_RECOMPUTE
    plans = []
    run_and_check_outputs(engine, plans)
    restart_plan = next(plan for plan in plans if any(s.request_id == "B" for s in plan.scheduled))
    restart = next(s for s in restart_plan.scheduled if s.request_id == "B")
    assert restart.start_position == 128 and engine.requests["B"].num_cached_prefix_tokens == 128
    restore = restart_plan.state_restores[0]
    assert (restore.request_id, restore.reason, restore.num_restored_tokens) == ("B", RestoreReason.PREFIX_HIT, 128)
    assert restart_plan.num_cached_tokens == 128


def test_pool_of_one_max_length_request_serialises_and_completes():
    config = SchedulerConfig(num_gpu_blocks=4, max_model_len=512, num_cpu_blocks=2, max_num_batched_tokens=256)
    engine = SimulatedEngine(Scheduler(config))
    for index in range(4):
        engine.add(make_request(f"r{index}", 200 + 30 * index, max_tokens=512 - 200 - 30 * index))
    plans = []
    run_and_check_outputs(engine, plans)
    assert sum(len(plan.preempted_request_ids) for plan in plans) > 0


def test_highest_priority_request_is_never_preempted_by_others():
    config = SchedulerConfig(num_gpu_blocks=6, max_model_len=768, num_cpu_blocks=1, max_num_running_seqs=3)
    engine = SimulatedEngine(Scheduler(config))
    for index in range(3):
        engine.add(make_request(f"r{index}", 300, max_tokens=400))
    preempted = set()
    engine.run_until_done(max_steps=3000, on_step=lambda r: preempted.update(r.plan.preempted_request_ids))
    assert "r0" not in preempted and preempted
