"""KV tiers and the local plan builder, without processes."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.model.state import SequenceState
from moemesh.bench.checks.tiny_model import random_hub_state_dict, split_hub_state_dict, tiny_config
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import SequenceResult, StepResult
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.services.attention.kv_pool import BlockTable, KVPool, KVPoolError, pool_segments
from moemesh.services.attention.local_plan import LocalPlanConfig, LocalPlanner, LocalRequest


def test_paged_rows_round_trip_through_the_cpu_tier():
    config = tiny_config()
    pool = KVPool(config, KVPoolConfig(block_size_tokens=8, num_primary_blocks=4, num_cpu_blocks=4),
                  torch.float32, "cpu")
    segment = pool_segments(config)[0]
    table = BlockTable(torch.device("cpu"))
    table.update((3, 1))
    store = pool.row_store_factory(table)(segment.layer, segment.which, segment.row_dim)
    rows = torch.randn(16 // segment.ratio, segment.row_dim)
    store.write(0, rows[:1])
    store.write(1, rows[1:])
    assert torch.equal(store.read(rows.shape[0]), rows)
    pool.move(swap_out=[(3, 0), (1, 2)], swap_in=[])
    pool.primary[(segment.layer, segment.which)].zero_()
    pool.move(swap_out=[], swap_in=[(0, 2), (2, 0)])  # back into other primary blocks
    table.update((2, 0))
    assert torch.equal(store.read(rows.shape[0]), rows)
    assert pool.num_blocks_swapped_out == 2 and pool.num_blocks_swapped_in == 2
    with pytest.raises(KVPoolError):
        store.read(rows.shape[0] + 16)  # beyond the table
    with pytest.raises(KVPoolError):
        pool.move(swap_out=[(4, 0)], swap_in=[])


def test_sequence_state_with_paged_rows_gives_the_same_logits():
    config = tiny_config()
    hub_sd, _ = random_hub_state_dict(config, seed=11)
    attention_sd, experts = split_hub_state_dict(hub_sd, config)
    model = ReferenceModel(AttentionSide.from_state_dict(config, attention_sd),
                           RoutedExperts.from_config(experts, config))
    pool = KVPool(config, KVPoolConfig(block_size_tokens=16, num_primary_blocks=6), torch.float32, "cpu")
    table = BlockTable(torch.device("cpu"))
    table.update((5, 2, 0))
    paged = SequenceState(config, row_store_factory=pool.row_store_factory(table))
    plain = model.new_sequence()
    token_ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    for start, end in ((0, 13), (13, 14), (14, 37), (37, 40)):
        chunk = token_ids[start:end]
        expected = model.forward(chunk, [SequenceChunk(plain, len(chunk))])
        got = model.forward(chunk, [SequenceChunk(paged, len(chunk))])
        assert torch.equal(got, expected)


def _drive_planner(planner: LocalPlanner, tokens_of):
    """Run the planner against a fake executor that returns tokens_of(request_id, position)."""
    plans = []
    while not planner.done:
        plan = planner.next_plan()
        plans.append(plan)
        results = []
        for seq in plan.sequences:
            end = seq.start_position + len(seq.token_ids)
            results.append(SequenceResult(seq.request_id, (tokens_of(seq.request_id, end),) if seq.do_sample else ()))
        planner.update(StepResult(step_id=plan.step_id, sequences=tuple(results)))
    return plans


def test_local_planner_spills_to_the_cpu_tier_and_returns():
    config = LocalPlanConfig(block_size_tokens=4, num_primary_blocks=6, num_cpu_blocks=8, max_chunk_tokens=5)
    params = SamplingParams(max_tokens=6)
    requests = [LocalRequest(f"r{i}", list(range(1, n + 1)), params) for i, n in enumerate((9, 6, 3))]
    planner = LocalPlanner(config, requests)
    plans = _drive_planner(planner, lambda rid, pos: 100 + pos)
    assert planner.num_swapped_out >= 1 and planner.num_swapped_in == planner.num_swapped_out
    assert any(p.swap_out for p in plans) and any(p.swap_in for p in plans)
    for request in requests:
        n = len(request.prompt_token_ids)
        assert request.output_token_ids == [100 + n + i for i in range(6)] and request.finish_reason == "length"
    held_cpu = set()
    for plan in plans:  # a CPU block is never a swap-out target while it holds blocks still to swap in
        for _, cpu in plan.swap_out:
            assert cpu not in held_cpu
            held_cpu.add(cpu)
        for cpu, _ in plan.swap_in:
            held_cpu.discard(cpu)
        slots_in_plan = [s.seq_slot for s in plan.sequences]
        assert len(set(slots_in_plan)) == len(slots_in_plan)
        assert not set(plan.free_seq_slots) & set(slots_in_plan)


def test_local_planner_stops_on_stop_tokens_and_frees_slots():
    planner = LocalPlanner(LocalPlanConfig(block_size_tokens=8, num_primary_blocks=4, max_num_seqs=1,
                                           eos_token_ids=(7,)),
                           [LocalRequest("a", [1, 2], SamplingParams(max_tokens=5)),
                            LocalRequest("b", [3], SamplingParams(max_tokens=5, stop_token_ids=(42,)))])
    _drive_planner(planner, lambda rid, pos: 7 if rid == "a" else 42)
    a, b = planner.requests
    assert a.output_token_ids == [7] and b.output_token_ids == [42]
    assert a.finish_reason == b.finish_reason == "stop"
