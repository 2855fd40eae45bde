"""Replicas with real expert worker processes: two workers each hold every (layer, expert), an
in-process attention worker dispatches to them over ipc sockets.

- least loaded and round robin both spread each expert's tokens over its two copies, and the
  generated tokens equal the single-process reference (placement-invariant combine: exact);
- SIGKILL of one worker mid-generation: the step that hit it is rolled back and retried at once
  on the live twin (no wait for a restart), every request completes with the reference tokens;
  the restarted worker is probed back in and carries traffic again.
"""

from __future__ import annotations

import time

import pytest

from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.generate import GenerationConfig, generate
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.sampling_params import SamplingParams
from moemesh.commands.generate_distributed import scheduler_config
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.services.router.offline_engine import OfflineEngine, RequestOutput
from moemesh.services.attention.recovery import RecoveryConfig
from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig
from moemesh.common.placement.worker_holdings import WorkerHoldings

PROMPTS = [[5, 9, 17], [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13], list(range(30, 52))]
MAX_TOKENS = 6

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = tiny_config(num_experts_per_tok=4)
    path = tmp_path_factory.mktemp("replica_ckpt")
    write_checkpoint(path, config, random_hub_state_dict(config, seed=71, include_mtp=False))
    reader = CheckpointReader(path, config=config)
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config))
    pairs = tuple((l, e) for l in range(config.num_hidden_layers) for e in range(config.n_routed_experts))
    model = ReferenceModel(side, RoutedExperts.from_config(reader.load_experts(config, pairs), config))
    reference = [generate(model, p, GenerationConfig(max_new_tokens=MAX_TOKENS)) for p in PROMPTS]
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path_factory.mktemp("replica_run")),
                       num_expert_workers=2, placement="all", with_attention=False)
    with LocalCluster(spec) as cluster:
        yield path, pairs, reference, cluster


def _attention(setup, policy: str, dispatch_timeout_s: float = 30.0) -> AttentionWorker:
    path, pairs, _, cluster = setup
    names = cluster.expert_names
    worker = AttentionWorker(AttentionWorkerConfig(
        name=f"attention-{policy}", checkpoint_path=str(path),
        expert_endpoints=tuple(cluster.endpoint_of(n) for n in names),
        expert_workers=tuple(WorkerHoldings(n, pairs) for n in names),  # both hold everything: twins
        placement_invariant=True, replica_policy=policy, dispatch_timeout_s=dispatch_timeout_s,
        recovery=RecoveryConfig(max_attempts=3, budget_s=20.0, readmit_interval_s=0.2, readmit_timeout_s=0.5)))
    worker.load_now()
    return worker


def _generate(worker: AttentionWorker, on_step=None) -> list[RequestOutput]:
    kv = worker.config.kv
    engine = OfflineEngine(scheduler_config(kv.block_size_tokens, kv.num_primary_blocks, kv.num_cpu_blocks),
                           worker.step)  # with recovery (rollback and retry)
    requests = [engine.add_request(f"req-{i}", p, SamplingParams(max_tokens=MAX_TOKENS)) for i, p in enumerate(PROMPTS)]
    num_steps = 0
    while not engine.done:
        if on_step is not None:
            on_step(num_steps)
        engine.step()
        num_steps += 1
    engine.release_slots()
    return requests


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
def test_replicas_share_the_load_with_unchanged_outputs(setup, policy):
    import asyncio

    _, _, reference, _ = setup
    worker = _attention(setup, policy)
    try:
        requests = _generate(worker)
        assert [r.error for r in requests] == [None] * len(PROMPTS)
        assert [r.output_token_ids for r in requests] == reference
        sent = worker.dispatcher.num_slot_tokens_sent  # expert-slot tokens per worker
        assert len(sent) == 2 and min(sent) > 0.3 * max(sent), sent
    finally:
        asyncio.run(worker.close())


def test_killed_replica_is_routed_around_then_readmitted(setup):
    import asyncio

    _, _, reference, cluster = setup
    worker = _attention(setup, "least_loaded", dispatch_timeout_s=1.0)
    killed = {}

    def on_step(num_steps: int) -> None:
        if num_steps == 2:
            cluster.processes["expert-1"].kill()
            cluster.processes["expert-1"].wait(10)
            killed["sent"] = list(worker.dispatcher.num_slot_tokens_sent)

    try:
        requests = _generate(worker, on_step)
        assert [r.error for r in requests] == [None] * len(PROMPTS)
        assert [r.output_token_ids for r in requests] == reference
        recovery = worker.recovery
        assert recovery.num_replica_retries >= 1 and recovery.num_failed_steps == 0
        assert recovery.num_waits == 0  # retried on the twin at once, never waited for a restart
        assert worker.dispatcher.slot_owners.router.down == {1}
        sent = worker.dispatcher.num_slot_tokens_sent
        assert sent[1] == killed["sent"][1] or sent[1] - killed["sent"][1] < sent[0] - killed["sent"][0]

        # the worker comes back: the readmission probe finds it holding its pairs, it serves again
        cluster.start_worker("expert", "expert-1")
        cluster.wait_ready()
        time.sleep(0.3)  # past readmit_interval_s
        before = list(worker.dispatcher.num_slot_tokens_sent)
        again = _generate(worker)
        assert [r.output_token_ids for r in again] == reference
        assert worker.dispatcher.slot_owners.router.down == set()
        assert worker.dispatcher.num_slot_tokens_sent[1] > before[1]
    finally:
        asyncio.run(worker.close())
