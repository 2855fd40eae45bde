"""Step counters: the attention worker's per-step cost figures, their sums at the router over decode steps,
and `moemesh bench serve`'s per-step / per-layer report from two `/status.json` snapshots."""

from __future__ import annotations

import torch

from moemesh.bench.serve import decode_step_costs
from moemesh.common.wire.messages import ScheduledSequence, StepCounters, StepPlan, StepResult
from moemesh.services.attention.step_counters import StepCounting, is_decode_plan
from moemesh.services.router.step_totals import DecodeStepTotals


def _sequence(num_tokens: int, num_drafts: int = 0) -> ScheduledSequence:
    tokens = tuple(range(num_tokens))
    return ScheduledSequence(request_id=f"r{num_tokens}", seq_slot=0, token_ids=tokens, start_position=4,
                             block_ids=((0,),), do_sample=False, draft_token_ids=tokens[num_tokens - num_drafts:])


class _Channel:
    num_layer_messages = 0


def test_a_step_counts_the_layer_messages_it_sent_and_whether_it_was_a_decode_step():
    channel = _Channel()
    counting = StepCounting(channel, torch.device("cpu"), num_layers=6, count_host_syncs=True)

    def run(plan):
        channel.num_layer_messages += 12  # two workers, six layers
        return StepResult(step_id=plan.step_id, sequences=())

    decode = StepPlan(step_id=1, sequences=(_sequence(1), _sequence(3, num_drafts=2)))
    prefill = StepPlan(step_id=2, sequences=(_sequence(1), _sequence(5)))
    assert is_decode_plan(decode) and not is_decode_plan(prefill)
    assert counting.count(decode, run).counters == StepCounters(decode=True, num_layers=6, data_messages=12,
                                                                host_syncs=-1)  # CPU: nothing to count
    assert counting.count(prefill, run).counters.decode is False


def test_the_router_adds_decode_steps_only_and_bench_serve_divides_by_steps_and_layers():
    totals = DecodeStepTotals()
    before = totals.to_json()
    totals.add(StepCounters(decode=False, num_layers=43, data_messages=500, host_syncs=90), 0.5)
    totals.add(StepCounters(decode=True, num_layers=43, data_messages=0, host_syncs=1), 0.003)
    totals.add(StepCounters(decode=True, num_layers=43, data_messages=0, host_syncs=3), 0.005)
    totals.add(None, 1.0)
    assert (totals.num_steps, totals.data_messages, totals.host_sync_steps, totals.host_syncs) == (2, 0, 2, 4)
    costs = decode_step_costs(before, totals.to_json())
    assert costs["num_decode_steps"] == 2 and costs["data_messages_per_step"] == 0.0
    assert abs(costs["decode_step_ms"] - 4.0) < 1e-9  # prefill steps left out
    assert costs["host_syncs_per_step"] == 2.0 and abs(costs["host_syncs_per_layer"] - 2.0 / 43) < 1e-12
    totals.add(StepCounters(decode=True, num_layers=43, data_messages=86), 0.011)  # syncs not counted
    costs = decode_step_costs(before, totals.to_json())
    assert costs["data_messages_per_step"] == 86 / 3 and costs["host_syncs_counted_steps"] == 2
    assert abs(costs["decode_step_ms"] - 19.0 / 3) < 1e-9
    assert decode_step_costs(None, totals.to_json()) is None  # another server: no counters
