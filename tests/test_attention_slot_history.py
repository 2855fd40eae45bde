"""A slot's token history (penalties, seeded random streams) across preemption and prefix hits.

The router sends a new sequence's prior tokens and prompt length with its first schedule in a
slot; the slot splits them into prompt and outputs, so a sequence resumed after a swap-out or a
recompute preemption has the output count (the index of its next random stream) and the history
it had before, and plan translation carries both fields.
"""

from __future__ import annotations

import random

import pytest

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.slots import Slot, SlotError
from moemesh.services.router.engine_plan import PlanTranslator
from moemesh.services.router.scheduler import Scheduler, SchedulerConfig
from moemesh.services.router.scheduler.request import Request
from sim_engine_support import SimulatedEngine


def _slot() -> Slot:
    return Slot("r", state=None, table=None, recorder=None, params=None, seed=None)


def test_history_splits_prompt_and_outputs_and_skips_known_tokens():
    slot = _slot()
    slot.begin_history(0, (), num_prompt_tokens=3)
    slot.record_tokens(0, [10, 11, 12])  # prefill
    slot.output_token_ids.append(20)  # sampled
    slot.record_tokens(3, [20])  # fed back: already known
    assert (slot.prompt_token_ids, slot.output_token_ids) == ([10, 11, 12], [20])
    # resumed after a preemption at a block boundary of 4: prior tokens cover the prompt and one output
    resumed = _slot()
    resumed.begin_history(4, (10, 11, 12, 20), num_prompt_tokens=3)
    assert (resumed.prompt_token_ids, resumed.output_token_ids) == ([10, 11, 12], [20])
    # a recompute preemption re-prefills outputs: they stay outputs
    recomputed = _slot()
    recomputed.begin_history(0, (), num_prompt_tokens=3)
    recomputed.record_tokens(0, [10, 11, 12, 20, 21])
    assert (recomputed.prompt_token_ids, recomputed.output_token_ids) == ([10, 11, 12], [20, 21])


def test_history_without_prompt_length_keeps_the_old_rule_and_refuses_gaps():
    slot = _slot()
    slot.begin_history(0, (), None)
    slot.record_tokens(0, [1, 2])
    slot.output_token_ids.append(3)
    slot.record_tokens(3, [4])  # tokens after the first output are outputs
    assert (slot.prompt_token_ids, slot.output_token_ids) == ([1, 2], [3, 4])
    with pytest.raises(SlotError, match="history ends at 4"):
        slot.record_tokens(6, [9])
    with pytest.raises(SlotError, match="prior tokens"):
        _slot().begin_history(1, (1, 2), 2)


def test_scheduler_sends_prior_tokens_and_prompt_length_to_restarting_sequences():
    """First schedule: no prior tokens; a swapped-out victim resumes at its block boundary with every
    token before it (prompt and outputs) and its prompt length, through plan translation."""
    config = SchedulerConfig(num_gpu_blocks=4, max_model_len=512, num_cpu_blocks=8, enable_prefix_caching=True)
    engine = SimulatedEngine(Scheduler(config))
    for request_id, num_prompt in (("A", 256), ("B", 250)):
        rng = random.Random(request_id)
        engine.add(Request(request_id, tuple(rng.randrange(1000) for _ in range(num_prompt)),
                           SamplingParams(max_tokens=200, ignore_eos=True, temperature=1.0, seed=3)))
    translator = PlanTranslator()
    plans = []
    first = engine.step().plan
    assert {(s.request_id, s.prior_token_ids, s.num_prompt_tokens) for s in first.scheduled} == {
        ("A", (), 256), ("B", (), 250)}
    resumed = None
    for _ in range(400):
        plan = engine.step().plan
        plans.append(plan)
        resumed = next((s for s in plan.scheduled if s.is_new_sequence and s.start_position > 0), None)
        if resumed is not None:
            break
    assert resumed is not None, "no sequence resumed at a boundary"
    request = engine.requests[resumed.request_id]
    assert resumed.prior_token_ids == tuple(request.token_ids_between(0, resumed.start_position))
    assert resumed.num_prompt_tokens == len(request.prompt_token_ids)
    wire = [s for p in translator.plans_for(plan) for s in p.sequences if s.request_id == resumed.request_id]
    assert wire[0].prior_token_ids == resumed.prior_token_ids and wire[0].num_prompt_tokens == resumed.num_prompt_tokens
    slot = _slot()
    slot.begin_history(resumed.start_position, wire[0].prior_token_ids, wire[0].num_prompt_tokens)
    num_outputs = resumed.start_position - len(request.prompt_token_ids)
    assert len(slot.output_token_ids) == max(0, num_outputs) and slot.prompt_token_ids == list(
        request.prompt_token_ids[: resumed.start_position])
