"""Random workloads run to completion with tiny pools: no deadlock, no leak, exact outputs.

The simulated worker checks every plan against the KV contract (slots, positions, block
contents after swaps, prefix hits and rollbacks), so a bookkeeping error anywhere fails here.
"""

from __future__ import annotations

import random

import pytest

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.scheduler import FinishReason, Request, Scheduler, SchedulerConfig
from sim_engine_support import SimulatedEngine, oracle_drafter

# (name, config): the first pool fits exactly one request of max_model_len.
CONFIGS = [
    ("one_max_request_no_cpu", dict(num_gpu_blocks=4, max_model_len=512, num_cpu_blocks=0)),
    ("one_max_request_small_cpu", dict(num_gpu_blocks=4, max_model_len=512, num_cpu_blocks=2)),
    ("tight_budget", dict(num_gpu_blocks=6, max_model_len=512, num_cpu_blocks=8,
                          max_num_batched_tokens=64, long_prefill_token_threshold=48, max_num_running_seqs=3)),
    ("block_256_no_cache", dict(num_gpu_blocks=3, max_model_len=768, num_cpu_blocks=1, block_size_tokens=256,
                                enable_prefix_caching=False)),
    ("few_snapshots", dict(num_gpu_blocks=6, max_model_len=512, num_cpu_blocks=8, num_gpu_snapshots=3,
                           num_cpu_snapshots=1, max_num_running_seqs=3, snapshot_interval_blocks=1)),
    ("graph_sized_prefills", dict(num_gpu_blocks=6, max_model_len=512, num_cpu_blocks=8, graph_chunk_tokens=8,
                                  graph_step_tokens=64, graph_prefill_token_threshold=200)),
]


def random_workload(rng: random.Random, config: SchedulerConfig, num_requests: int) -> list[Request]:
    shared_prefixes = [tuple(rng.randrange(50) for _ in range(rng.choice((128, 200, 256)))) for _ in range(2)]
    requests = []
    for index in range(num_requests):
        prefix = rng.choice(shared_prefixes) if rng.random() < 0.5 else ()
        num_prompt = rng.randint(1, config.max_model_len // 2)
        prompt = (prefix + tuple(rng.randrange(50) for _ in range(num_prompt)))[: config.max_model_len - 1]
        max_tokens = rng.randint(1, min(300, config.max_model_len - len(prompt)))
        eos = (rng.randrange(50),) if rng.random() < 0.3 else ()
        requests.append(Request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=eos))
    return requests


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name,config_values", CONFIGS, ids=[name for name, _ in CONFIGS])
def test_random_workload_completes_without_leak(name, config_values, seed):
    config = SchedulerConfig(**config_values)
    rng = random.Random(f"{name}/{seed}")
    drafter = oracle_drafter(rng.randint(1, 4), num_wrong_at=rng.choice((None, 0, 1, 2)))
    engine = SimulatedEngine(Scheduler(config), drafter=drafter if seed else None, vocab_size=50)
    pending = random_workload(rng, config, num_requests=16)
    aborted = set()

    def on_step(record):
        plan = record.plan
        assert plan.num_scheduled_tokens <= config.max_num_batched_tokens
        assert all(seq.num_tokens <= config.long_prefill_token_threshold for seq in plan.scheduled)
        if engine.scheduler.chunking.graph_chunks:  # a prompt within the threshold computes graph-sized chunks only
            assert all(seq.num_tokens <= config.graph_chunk_tokens for seq in plan.scheduled
                       if engine.requests[seq.request_id].num_tokens <= config.graph_prefill_token_threshold)
        stats = engine.scheduler.stats()
        assert stats.num_running_seqs <= config.max_num_running_seqs
        if plan.preempted_request_ids:  # a step that preempts admits nothing
            assert not plan.swap_in and not any(seq.is_new_sequence for seq in plan.scheduled)
        restored_ids = {restore.request_id for restore in plan.state_restores}
        if any(seq.is_new_sequence and seq.request_id not in restored_ids for seq in plan.scheduled):
            assert stats.num_swapped_seqs == 0  # swapped requests come back before new ones
        if pending and rng.random() < 0.5:
            engine.add(pending.pop())  # arrivals over time
        if rng.random() < 0.005:
            live = [rid for rid, request in engine.requests.items() if not request.is_finished]
            if live:
                victim = rng.choice(live)
                engine.scheduler.abort(victim)
                aborted.add(victim)

    engine.add(pending.pop())
    for _ in range(200):
        engine.run_until_done(max_steps=20_000, on_step=on_step)
        if not pending:
            break
        engine.add(pending.pop())
    assert not pending
    for request_id, request in engine.requests.items():
        assert request.is_finished
        if request_id in aborted:
            assert request.finish_reason is FinishReason.ABORT
            continue
        expected = engine.expected_output(request, request.num_output_tokens)
        assert request.output_token_ids == expected
        if request.finish_reason is FinishReason.LENGTH:
            assert request.num_output_tokens == request.sampling_params.max_tokens
        else:
            assert request.finish_reason is FinishReason.STOP
            assert request.output_token_ids[-1] in request.eos_token_ids
    stats = engine.scheduler.stats()
    assert stats.num_gpu_blocks_used == 0 and stats.num_cpu_blocks_used == 0
    snapshots = engine.scheduler.kv.snapshots
    assert snapshots.gpu.num_used_blocks == 0 and snapshots.cpu.num_used_blocks == 0
    assert stats.num_free_state_slots == config.max_num_running_seqs
    assert stats.num_waiting_prompt_tokens == 0
    assert stats.counters.num_finished_requests + stats.counters.num_aborted_requests == 16
