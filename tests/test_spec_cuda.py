"""The draft worker on CUDA (skipped without it): the same proposals as on the CPU, in float32.

A bf16/fp16 device drafter replays its block forward as CUDA graphs (draft_graphs.py); a second device
worker without graphs checks that the replays give the eager forward's proposals, greedy and sampled.

Greedy drafts on cuda:0 must be the CPU drafter's tokens (fp32 on both, so only an exact near-tie
within ~1e-5 could flip one; fixed seeds keep the inputs the same on every run),
sampled drafts must be valid sparse distributions with the drawn token in their support, and
the batched forward must equal one request at a time on the device.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from moemesh.common.wire import messages as m
from moemesh.common.speculation_width import SpeculationConfig, SpeculationMode
from moemesh.common.drafting.proposer import DrafterConfig
from moemesh.services.draft.worker import DraftWorker

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="default model not present"),
]


def _worker(device: str, dtype: str = "float32", cuda_graphs: bool = True) -> DraftWorker:
    worker = DraftWorker(DrafterConfig(checkpoint_path=str(MODEL), device=device, dtype=dtype, draft_sampling="sampled",
                                       speculation=SpeculationConfig(SpeculationMode.FIXED, width=5),
                                       cuda_graphs=cuda_graphs))
    asyncio.run(worker.load())
    return worker


def _features(worker: DraftWorker, count: int, seed: int) -> torch.Tensor:
    width = len(worker.drafter.dspark.target_layer_ids) * worker.drafter.config.hidden_size
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed))  # [n, F] on the host


def _feed(worker: DraftWorker, contexts: dict[str, torch.Tensor]) -> None:
    for request_id, features in contexts.items():
        segment = m.FeatureSegment(request_id, 0, features.shape[0], 0, tuple(range(features.shape[0])))
        worker.add_features(m.TargetFeatures(step_id=0, segments=(segment,), features=features))


@pytest.fixture(scope="module")
def workers():
    return _worker("cpu"), _worker("cuda:0")


def test_greedy_drafts_on_cuda_equal_the_cpu_drafts(workers):
    cpu, gpu = workers
    contexts = {f"r{i}": _features(cpu, count, seed=i) for i, count in enumerate((5, 40, 130, 77))}
    _feed(cpu, contexts)
    _feed(gpu, contexts)
    slots = tuple(m.DraftSlot(request_id, 5, (20 + i,), features.shape[0])
                  for i, (request_id, features) in enumerate(contexts.items()))
    request = m.DraftRequest(step_id=1, slots=slots)
    cpu_reply, gpu_reply = cpu.propose(request), gpu.propose(request)
    for left, right in zip(cpu_reply.proposals, gpu_reply.proposals):
        assert left.token_ids == right.token_ids, left.request_id
        torch.testing.assert_close(torch.tensor(right.draft_probs), torch.tensor(left.draft_probs),
                                   rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(torch.tensor(right.confidences), torch.tensor(left.confidences),
                                   rtol=1e-3, atol=1e-5)
    # batching is invisible on the device too
    for slot, batched in zip(slots, gpu_reply.proposals):
        alone = gpu.propose(m.DraftRequest(step_id=2, slots=(slot,))).proposals[0]
        assert alone.token_ids == batched.token_ids


def test_sampled_drafts_on_cuda_are_valid_and_reproducible(workers):
    _, gpu = workers
    contexts = {"s0": _features(gpu, 30, seed=10), "s1": _features(gpu, 3, seed=11)}
    _feed(gpu, contexts)
    slots = tuple(m.DraftSlot(request_id, 5, (30,), features.shape[0], temperature=0.8, seed=7,
                              first_output_position=4) for request_id, features in contexts.items())
    request = m.DraftRequest(step_id=3, slots=slots)
    first, second = gpu.propose(request), gpu.propose(request)
    assert first == second
    for proposal in first.proposals:
        assert len(proposal.token_ids) == 5
        for token, ids, probs, chosen in zip(proposal.token_ids, proposal.support_token_ids, proposal.support_probs,
                                             proposal.draft_probs):
            assert token in ids
            assert abs(sum(probs) - 1.0) < 1e-4
            assert abs(probs[ids.index(token)] - chosen) < 1e-6


def test_a_float32_drafter_runs_eagerly(workers):
    assert workers[1].graphs is None  # its experts group tokens on the host: not capturable


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_graph_replays_propose_what_the_eager_forward_proposes(dtype):
    graphed, eager = _worker("cuda:0", dtype), _worker("cuda:0", dtype, cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    contexts = {f"g{i}": _features(graphed, count, seed=20 + i) for i, count in enumerate((3, 128, 60))}
    _feed(graphed, contexts)
    _feed(eager, contexts)
    greedy = tuple(m.DraftSlot(request_id, 5, (40 + i,), features.shape[0])
                   for i, (request_id, features) in enumerate(contexts.items()))
    sampled = tuple(m.DraftSlot(request_id, 5, (50 + i,), features.shape[0], temperature=0.9, seed=3 + i,
                                first_output_position=2) for i, (request_id, features) in enumerate(contexts.items()))
    # the graph pads every context to the ring's 128 positions, the eager forward to the longest one: the
    # projections' rounding may differ in the last bit, so only the greedy tokens must agree exactly
    tolerance = dict(rtol=3e-2, atol=2e-3)
    for step_id, slots in enumerate((greedy, greedy[:1], greedy[:2] + sampled[2:], sampled)):
        request = m.DraftRequest(step_id=step_id, slots=slots)
        got, want = graphed.propose(request), eager.propose(request)
        for slot, left, right in zip(slots, got.proposals, want.proposals):
            if slot.temperature == 0:
                assert left.token_ids == right.token_ids, (step_id, left.request_id)
            same = left.token_ids == right.token_ids  # else the chains part after the first differing draft
            for name in ("draft_probs", "confidences"):
                left_values, right_values = getattr(left, name), getattr(right, name)
                torch.testing.assert_close(torch.tensor(left_values if same else left_values[:1]),
                                           torch.tensor(right_values if same else right_values[:1]), **tolerance)
    assert graphed.graphs.num_replays == 4  # every proposal replayed a graph (buckets 4, 1, 4, 4)
    again = graphed.propose(m.DraftRequest(step_id=9, slots=sampled))
    assert again == graphed.propose(m.DraftRequest(step_id=9, slots=sampled))  # keyed draws: reproducible
    for proposal in again.proposals:  # drawn in the replay from a valid sparse q
        assert len(proposal.token_ids) == 5
        for token, ids, probs, chosen in zip(proposal.token_ids, proposal.support_token_ids, proposal.support_probs,
                                             proposal.draft_probs):
            assert list(ids) == sorted(ids) and token in ids
            assert abs(sum(probs) - 1.0) < 1e-4
            assert probs[ids.index(token)] == chosen
