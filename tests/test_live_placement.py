"""Live placement changes: load on new owners -> switch between two steps -> drop.

Three expert worker processes (real ipc sockets) serve an in-process attention worker while
three greedy requests are mid-generation. The placement changes twice under them: scale in
(all experts on expert-0, the two others drop everything) and scale out with replicas
(expert-1 / expert-2 split the experts, expert-0 holds a replica of every pair, so round robin
sends each pair's traffic to two workers). Every request must complete with the reference's
tokens (placement-invariant combine: exact).
"""

from __future__ import annotations

import asyncio

import pytest
import zmq

from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.generate import GenerationConfig, generate
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.placement.placement_file import Placement, WorkerPlacement
from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import (
    ErrorReply, ExpertKey, LoadExperts, PlacementWorker, QueryInventory, SwitchPlacement,
)
from moemesh.common.wire.transport import SyncClient
from moemesh.commands.generate_distributed import scheduler_config
from moemesh.commands.serve_config import write_split_placement
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.services.router.offline_engine import OfflineEngine
from moemesh.services.attention.placement_switch import replica_owner_tables
from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig
from moemesh.common.placement.worker_holdings import WorkerHoldings, round_robin
from moemesh.services.router.placement_admin import PlacementAdmin, PlacementApplyError

PROMPTS = [[5, 9, 17], [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13], list(range(30, 52))]
MAX_TOKENS = 8


class InProcessAttention:
    """The admin's client of an in-process attention worker (what a SyncClient is to a process)."""

    def __init__(self, worker: AttentionWorker) -> None:
        self.worker = worker

    def request(self, message, timeout_s=None):
        return asyncio.run(self.worker.handle(message))


def test_replica_owner_tables_round_robin_over_copies():
    workers = [WorkerHoldings("a", ((0, 0), (0, 1))), WorkerHoldings("b", ((0, 2),), ((0, 0),))]
    assert replica_owner_tables(workers, 1, 3) == [[[0, 0, 1]], [[1, 0, 1]]]
    with pytest.raises(ValueError):
        replica_owner_tables([WorkerHoldings("a", ((0, 0),))], 1, 2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = tiny_config(num_experts_per_tok=4)
    path = tmp_path_factory.mktemp("live_ckpt")
    write_checkpoint(path, config, random_hub_state_dict(config, seed=33, include_mtp=False))
    reader = CheckpointReader(path, config=config)
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config))
    pairs = [(l, e) for l in range(config.num_hidden_layers) for e in range(config.n_routed_experts)]
    model = ReferenceModel(side, RoutedExperts.from_config(reader.load_experts(config, pairs), config))
    reference = [generate(model, p, GenerationConfig(max_new_tokens=MAX_TOKENS)) for p in PROMPTS]
    run_dir = tmp_path_factory.mktemp("live_run")
    placement = write_split_placement(str(path), run_dir / "placement.toml", "round_robin", 3, ["cpu"])
    spec = ClusterSpec(model_path=str(path), run_dir=str(run_dir), num_expert_workers=3, placement=placement,
                       with_attention=False)
    with LocalCluster(spec) as cluster:
        yield path, config, reference, cluster
    assert cluster.exit_codes == {name: 0 for name in cluster.expert_names}


def all_pairs_of(config) -> tuple[tuple[int, int], ...]:
    return tuple((l, e) for l in range(config.num_hidden_layers) for e in range(config.n_routed_experts))


def _placement(config, workers: list[tuple[str, list, list]]) -> Placement:
    return Placement(config.num_hidden_layers, config.n_routed_experts, 1, tuple(
        WorkerPlacement(name=n, device="cpu", expert_ids=tuple(p), replica_ids=tuple(r)) for n, p, r in workers))


def test_scale_in_then_out_with_replicas_mid_generation(setup):
    path, config, reference, cluster = setup
    names = cluster.expert_names
    endpoints = {n: cluster.endpoint_of(n) for n in names}
    start = round_robin(names, ["cpu"] * 3, config.num_hidden_layers, config.n_routed_experts, 1)
    worker = AttentionWorker(AttentionWorkerConfig(
        name="attention-live", checkpoint_path=str(path), expert_endpoints=(endpoints[names[0]],),
        expert_workers=(WorkerHoldings(names[0], all_pairs_of(config)),), placement_invariant=True,
        dispatch_timeout_s=30.0))
    context = zmq.Context()
    clients: dict[str, SyncClient] = {}

    def expert_client(name, endpoint):
        if name not in clients:
            clients[name] = SyncClient(endpoint, context=context, default_timeout_s=60.0)
        return clients[name]

    try:
        # expert-0 starts holding every pair and the attention worker knows only its endpoint;
        # the first switch (scale out) connects the two others on the fly
        all_pairs = [(l, e) for l in range(config.num_hidden_layers) for e in range(config.n_routed_experts)]
        expert_client(names[0], endpoints[names[0]]).request(
            LoadExperts(placement_version=0, experts=tuple(ExpertKey(l, e) for l, e in all_pairs)))
        worker.load_now()
        admin = PlacementAdmin(expert_client, [InProcessAttention(worker)])
        held_start = {w.name: list(w.expert_ids) for w in start.workers}
        stages = [
            _placement(config, [(n, held_start[n], []) for n in names]),  # scale out 1 -> 3 (one owner each)
            _placement(config, [(names[0], all_pairs, [])]),  # scale in to 1
            _placement(config, [(names[1], [p for p in all_pairs if p[1] % 2 == 0], []),  # rebalance, replicas
                                (names[2], [p for p in all_pairs if p[1] % 2 == 1], []),
                                (names[0], [], all_pairs)]),
        ]
        kv = worker.config.kv
        engine = OfflineEngine(scheduler_config(kv.block_size_tokens, kv.num_primary_blocks, kv.num_cpu_blocks),
                               worker.step)
        requests = [engine.add_request(f"req-{i}", p, SamplingParams(max_tokens=MAX_TOKENS))
                    for i, p in enumerate(PROMPTS)]
        reports, num_steps = [], 0
        previous = {names[0]: endpoints[names[0]]}
        while not engine.done:
            if num_steps in (1, 3, 5) and stages:
                reports.append(admin.apply(stages.pop(0), endpoints, previous_endpoints=previous))
                previous = None
            engine.step()
            num_steps += 1
        assert not stages, f"generation ended after {num_steps} steps, before every switch"
        assert [r.error for r in requests] == [None] * 3
        assert [r.output_token_ids for r in requests] == reference
        assert [r.placement_version for r in reports] == [1, 2, 3]
        assert reports[0].num_dropped_by_worker[names[0]] > 0  # scale out: expert-0 kept a third
        assert reports[1].num_dropped_by_worker[names[1]] > 0  # scale in emptied expert-1 / expert-2
        assert reports[2].num_loaded_by_worker[names[1]] > 0
        inventories = {n: {(k.layer, k.expert) for k in expert_client(n, endpoints[n]).request(QueryInventory()).experts}
                       for n in names}
        assert inventories[names[0]] == set(all_pairs)
        assert inventories[names[1]] == {p for p in all_pairs if p[1] % 2 == 0}
        assert worker.dispatcher.slot_owners.owners.shape[0] == 2  # two copies of every pair: two round-robin tables
        assert len(worker.channel.sockets) == 3

        # a placement that leaves pairs unowned is refused by the attention worker before any switch
        bad = SwitchPlacement(placement_version=9, workers=(PlacementWorker(names[1], endpoints[names[1]], ()),))
        assert isinstance(asyncio.run(worker.handle(bad)), ErrorReply)
        with pytest.raises(PlacementApplyError):
            admin.apply(_placement(config, [(names[1], all_pairs[:1], [])]), {})
    finally:
        for client in clients.values():
            client.close()
        context.term()
        asyncio.run(worker.close())


def test_admin_route_applies_a_placement_behind_the_api_key(setup):
    """POST /v1/admin/placement through the real route and auth middleware: 401 without the key,
    400 for a malformed body, 200 with the report after expert-2 loaded every pair."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from moemesh.common.placement.placement_file import format_toml
    from moemesh.common.security.api_keys import ApiKeys
    from moemesh.services.router.auth_middleware import GatewayAuthConfig, install_bearer_auth
    from moemesh.services.router.placement_admin import placement_route

    _, config, _, cluster = setup
    name = cluster.expert_names[2]
    endpoint = cluster.endpoint_of(name)
    context = zmq.Context()
    client = SyncClient(endpoint, context=context, default_timeout_s=60.0)
    try:
        before = {(k.layer, k.expert) for k in client.request(QueryInventory()).experts}
        admin = PlacementAdmin(lambda _name, _endpoint: client, [])
        app = Starlette(routes=[placement_route(admin, {name: endpoint})])
        install_bearer_auth(app, GatewayAuthConfig(api_keys=ApiKeys.from_keys(["sk-live-test"])))
        body = {"placement_toml": format_toml(_placement(config, [(name, list(all_pairs_of(config)), [])]))}
        with TestClient(app) as http:
            assert http.post("/v1/admin/placement", json=body).status_code == 401
            auth = {"Authorization": "Bearer sk-live-test"}
            assert http.post("/v1/admin/placement", json={"placement_toml": "nope ["}, headers=auth).status_code == 400
            response = http.post("/v1/admin/placement", json=body, headers=auth)
        assert response.status_code == 200, response.text
        assert response.json() == {"placement_version": 1, "loaded": {name: len(set(all_pairs_of(config)) - before)},
                                   "dropped": {name: 0}}
        after = {(k.layer, k.expert) for k in client.request(QueryInventory()).experts}
        assert after == set(all_pairs_of(config))
    finally:
        client.close()
        context.term()
