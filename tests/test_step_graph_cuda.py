"""The whole decode step as one CUDA graph (graph_decode.DecodeGraphs.execute) when the attention worker
computes every routed expert itself, on the embedded default model (FP4 experts, bf16).

The same requests run through an attention worker with every expert in its own process, once with CUDA
graphs and once eagerly, driven by the router's scheduler (`OfflineEngine`): the greedy tokens are equal,
the logits agree to bf16 rounding, every decode step was one replay of a step graph, and the routing
counts per (phase, layer) add up to the same number of slots (padding rows of a bucket are not
counted). A new routing table (a placement switch) makes the next step capture again. Skipped without
CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
PROMPTS = [[5, 9, 17], [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13], list(range(30, 52))]
NAME = "attention-step-graph"


def _worker(cuda_graphs: bool):
    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.placement.worker_holdings import WorkerHoldings, all_pairs
    from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig

    config = CheckpointReader(MODEL).config
    pairs = tuple(all_pairs(config.num_hidden_layers, config.n_routed_experts))
    worker = AttentionWorker(AttentionWorkerConfig(
        name=NAME, checkpoint_path=str(MODEL), expert_endpoints=(), expert_workers=(), device="cuda",
        cuda_graphs=cuda_graphs, local_holdings=WorkerHoldings(NAME, pairs)))
    worker.load_now()
    return worker


def _run(worker, prompts, max_tokens: int, before_step=lambda num_steps: None):
    from moemesh.common.sampling_params import SamplingParams
    from attention_worker_support import run_offline

    return run_offline(worker, prompts, SamplingParams(max_tokens=max_tokens), before_step)


def _slots_per_phase_and_layer(worker) -> torch.Tensor:
    return worker.routing.counts.sum(dim=-1).cpu()  # [P, L]: counted slots


def test_step_graph_matches_the_eager_step(open_workers):
    graphed, eager = _worker(True), _worker(False)
    open_workers += [graphed, eager]
    assert graphed.dispatcher.every_layer_here()
    got_tokens, got_logits = _run(graphed, PROMPTS, max_tokens=12)
    want_tokens, want_logits = _run(eager, PROMPTS, max_tokens=12)
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits)
    for got, want in zip(got_logits, want_logits):
        if want is None:
            assert got is None
            continue
        assert float((got - want).norm() / want.norm()) < 2e-2
    stats = graphed.runner.graphs.stats
    assert stats.num_step_graph_steps > 0
    assert stats.num_step_graph_steps == stats.num_graph_steps  # every graph step was one replay
    # three sequences decode in a bucket of 4 at times: its padding row is not counted
    assert torch.equal(_slots_per_phase_and_layer(graphed), _slots_per_phase_and_layer(eager))
    assert graphed.dispatcher.num_slot_tokens_sent == eager.dispatcher.num_slot_tokens_sent


def test_a_new_routing_table_captures_the_step_again(open_workers):
    worker = _worker(True)
    open_workers.append(worker)
    dispatcher = worker.dispatcher
    captures = []  # captures so far, before each step

    def switch_at_step_four(num_steps: int) -> None:
        captures.append(worker.runner.graphs.stats.num_captures)
        if num_steps == 4:  # the same holders in a new table: what a placement switch installs
            dispatcher.slot_owners.set_holders(dispatcher.slot_owners.router.holders)

    tokens, _ = _run(worker, PROMPTS[:1], max_tokens=8, before_step=switch_at_step_four)
    assert captures[:3] == [0, 1, 2]  # step 0 (a 3-token prompt: a short chunk, bucket 4) and step 1 capture
    assert captures[5] == captures[4] + 1  # step 4 ran under the new table: captured again
    eager = _worker(False)
    open_workers.append(eager)
    reference, _ = _run(eager, PROMPTS[:1], max_tokens=8)
    assert tokens == reference
