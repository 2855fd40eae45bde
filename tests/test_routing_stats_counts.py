"""Routing statistics of the attention worker.

An in-process AttentionWorker with real expert workers (threads, real ipc sockets) runs prompts;
its per-(layer, expert) counts, split into prefill and decode, must equal a direct bincount of the
gate ids the single-process reference model produced on the same prompts. The counts are
written on request as Lucebox hotness tables (read back with `read_csv`) and reach /metrics as
per-layer skew.
"""

from __future__ import annotations

import re

import pytest
import torch
import zmq

from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.generate import GenerationConfig, generate
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.placement.stats import Phase, layer_skew, read_csv
from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import ErrorReply, RoutingPhase, RoutingStatsWritten, WriteRoutingStats
from dispatch_support import ThreadedExpert, expert_worker, write_tiny_checkpoint
from moemesh.commands.generate_distributed import scheduler_config
from moemesh.services.router.offline_engine import OfflineEngine
from moemesh.services.attention.routing_config import RoutingStatsConfig
from moemesh.services.attention.routing_stats import RoutingCounter
from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig
from moemesh.common.placement.worker_holdings import round_robin, WorkerHoldings
from moemesh.services.router.metrics import RouterMetrics

PROMPTS = [[5, 9, 17], [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13], list(range(30, 52))]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("routing_ckpt")
    return path, write_tiny_checkpoint(path, seed=11)


@pytest.fixture(scope="module")
def reference_counts(checkpoint):
    """(outputs, counts[phase] [L, E]) from the single-process reference, prompt by prompt."""
    path, config = checkpoint
    reader = CheckpointReader(path, config=config)
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config))
    pairs = [(l, e) for l in range(config.num_hidden_layers) for e in range(config.n_routed_experts)]
    experts = RoutedExperts.from_config(reader.load_experts(config, pairs), config)
    rows_by_layer: dict[int, list[torch.Tensor]] = {}

    def recording_experts(layer, hidden, ids, weights):
        rows_by_layer.setdefault(layer, []).append(ids.clone())  # [T, K]
        return experts(layer, hidden, ids, weights)

    model = ReferenceModel(side, recording_experts)
    counts = {phase: torch.zeros(config.num_hidden_layers, config.n_routed_experts, dtype=torch.long)
              for phase in (Phase.PREFILL, Phase.DECODE)}
    outputs = []
    for prompt in PROMPTS:
        rows_by_layer.clear()
        outputs.append(generate(model, prompt, GenerationConfig(max_new_tokens=MAX_TOKENS)))
        for layer, rows in rows_by_layer.items():
            ids = torch.cat(rows)  # [prompt + fed-back tokens, K], in feeding order
            for phase, part in ((Phase.PREFILL, ids[:len(prompt)]), (Phase.DECODE, ids[len(prompt):])):
                counts[phase][layer] += torch.bincount(part.reshape(-1), minlength=config.n_routed_experts)
    return outputs, counts


@pytest.fixture(scope="module")
def experts(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    run_dir = tmp_path_factory.mktemp("routing_run")
    context = zmq.Context()
    servers = [ThreadedExpert(expert_worker(path, f"expert-{i}"), f"ipc://{run_dir}/expert-{i}.sock", context).start()
               for i in range(2)]
    yield servers
    for server in servers:
        server.stop()
    context.term()


def _worker(checkpoint, experts, **fields) -> AttentionWorker:
    path, config = checkpoint
    names = [f"expert-{i}" for i in range(len(experts))]
    placement = round_robin(names, ["cpu"] * len(names), config.num_hidden_layers, config.n_routed_experts, 1)
    worker = AttentionWorker(AttentionWorkerConfig(
        name="attention-routing", checkpoint_path=str(path), expert_endpoints=tuple(s.endpoint for s in experts),
        expert_workers=tuple(WorkerHoldings(w.name, w.expert_ids) for w in placement.workers),
        placement_invariant=True, num_micro_batches=2, dispatch_timeout_s=30.0, **fields))
    worker.load_now()
    return worker


def _run(worker: AttentionWorker):
    summaries = []

    def execute(plan):
        result = worker.step(plan)
        if result.routing is not None:
            summaries.append(result.routing)
        return result

    kv = worker.config.kv
    engine = OfflineEngine(scheduler_config(kv.block_size_tokens, kv.num_primary_blocks, kv.num_cpu_blocks), execute)
    requests = [engine.add_request(f"req-{i}", p, SamplingParams(max_tokens=MAX_TOKENS)) for i, p in enumerate(PROMPTS)]
    engine.run()
    return requests, summaries


@pytest.fixture(scope="module")
def ran(checkpoint, experts, tmp_path_factory):
    out_path = tmp_path_factory.mktemp("routing_out") / "stats.csv"
    worker = _worker(checkpoint, experts, routing_stats=RoutingStatsConfig(out_path=str(out_path),
                                                                          summary_every_steps=2))
    requests, summaries = _run(worker)
    return worker, requests, summaries, out_path


def test_prefill_and_decode_counts_equal_a_bincount_of_the_reference_gate_ids(checkpoint, reference_counts, ran):
    _, config = checkpoint
    outputs, expected = reference_counts
    worker, requests, _, _ = ran
    assert [r.output_token_ids for r in requests] == outputs  # same tokens, so the same gate inputs
    stats = worker.routing.snapshot()
    for phase in (Phase.PREFILL, Phase.DECODE):
        assert stats.counts((phase,)) == expected[phase].tolist(), phase
    num_prefill = sum(len(p) for p in PROMPTS)
    num_decode = sum(len(r.output_token_ids) - 1 for r in requests)  # the last sampled token is never fed back
    assert stats.num_activations((Phase.PREFILL,)) == num_prefill * config.num_experts_per_tok * config.num_hidden_layers
    assert stats.num_activations((Phase.DECODE,)) == num_decode * config.num_experts_per_tok * config.num_hidden_layers


def test_step_results_carry_a_skew_summary_every_n_steps(checkpoint, ran):
    _, config = checkpoint
    worker, _, summaries, _ = ran
    assert summaries and [s.num_steps for s in summaries] == list(range(2, 2 * len(summaries) + 1, 2))
    last = summaries[-1]
    all_phase = [entry for entry in last.layers if entry.phase is RoutingPhase.ALL]
    assert [entry.layer for entry in all_phase] == list(range(config.num_hidden_layers))
    assert {entry.phase for entry in last.layers} == {RoutingPhase.PREFILL, RoutingPhase.DECODE, RoutingPhase.ALL}


def test_write_on_request_gives_lucebox_tables_read_csv_reads(checkpoint, ran, tmp_path):
    worker, _, _, out_path = ran
    import asyncio

    reply = asyncio.run(worker.handle(WriteRoutingStats()))  # empty path: the --routing-stats-out file
    assert isinstance(reply, RoutingStatsWritten)
    assert reply.paths == (str(out_path), str(out_path.with_name("stats.prefill.csv")),
                           str(out_path.with_name("stats.decode.csv")))
    stats = worker.routing.snapshot()
    assert read_csv(out_path).counts() == stats.counts()
    for phase in (Phase.PREFILL, Phase.DECODE):
        assert read_csv(reply.paths[1 if phase is Phase.PREFILL else 2]).counts((phase,)) == stats.counts((phase,))
    first_line = out_path.read_text().splitlines()[0]
    assert first_line.startswith("# hotness table: n_layer=") and "n_expert_used=4" in first_line
    other = tmp_path / "elsewhere.csv"
    reply = asyncio.run(worker.handle(WriteRoutingStats(path=str(other))))
    assert isinstance(reply, RoutingStatsWritten) and read_csv(other).counts() == stats.counts()


def test_write_without_any_path_is_an_error(checkpoint, experts):
    import asyncio

    worker = _worker(checkpoint, experts)  # no --routing-stats-out
    try:
        reply = asyncio.run(worker.handle(WriteRoutingStats()))
        assert isinstance(reply, ErrorReply) and "--routing-stats-out" in reply.message
    finally:
        asyncio.run(worker.close())


def test_metrics_show_per_layer_skew():
    counter = RoutingCounter(num_layers=2, num_experts=4, num_experts_per_tok=2, device=torch.device("cpu"))
    counter.add(0, torch.tensor([[0, 1], [0, 2], [0, 3]]), torch.tensor([False, False, True]))  # layer 0 skewed
    counter.add(1, torch.tensor([[0, 1], [2, 3]]), None)  # layer 1 uniform, prefill only
    summary = counter.summary()
    metrics = RouterMetrics(lambda: {"routing_summary": summary})
    text = metrics.render().decode()

    def value(name, layer, phase):
        match = re.search(rf'^{name}{{layer="{layer}",phase="{phase}"}} (\S+)$', text, re.MULTILINE)
        assert match, (name, layer, phase)
        return float(match.group(1))

    assert value("moemesh_routing_max_over_mean", 0, "all") == pytest.approx(layer_skew(0, [3, 1, 1, 1]).max_over_mean)
    assert value("moemesh_routing_max_over_mean", 1, "all") == pytest.approx(1.0)
    assert value("moemesh_routing_max_over_mean", 0, "decode") == pytest.approx(2.0)  # [1, 0, 0, 1]
    assert value("moemesh_routing_unused_experts", 0, "decode") == 2
    assert value("moemesh_routing_activations_total", 0, "prefill") == 4
    assert value("moemesh_routing_effective_experts", 1, "prefill") == pytest.approx(4.0)
    assert "moemesh_routing_max_over_mean" not in RouterMetrics(lambda: {}).render().decode()
