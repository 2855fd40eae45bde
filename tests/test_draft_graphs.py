"""The drafter's graph path (common/drafting/draft_graphs.py) on the CPU, without capture: every request's
context padded to the ring's 128 positions, the chains of greedy and sampled rows computed over the static
buffers with key-derived draws, must propose what the eager forward proposes (`batched_chains` over contexts
padded to the longest ring). The captured replays are checked against the eager path on CUDA
(tests/test_spec_cuda.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moemesh.common.drafting.draft_graphs import DraftGraphs
from moemesh.common.drafting.proposer import DrafterConfig, DraftProposer
from moemesh.common.speculation_width import SpeculationConfig, SpeculationMode
from moemesh.common.wire import messages as m

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="default model not present")


def _proposer(graphs: bool) -> DraftProposer:
    proposer = DraftProposer(DrafterConfig(checkpoint_path=str(MODEL), device="cpu", dtype="float32",
                                           draft_sampling="sampled",
                                           speculation=SpeculationConfig(SpeculationMode.FIXED, width=5)))
    proposer.load_now()
    if graphs:
        proposer.graphs = DraftGraphs(proposer.drafter, proposer.drafter.config.sliding_window,
                                      proposer.config.max_support, buckets=(1, 2, 4), capture=False)
    return proposer


@pytest.fixture(scope="module")
def proposers():
    torch.manual_seed(0)
    graphed, eager = _proposer(True), _proposer(False)
    width = len(graphed.drafter.dspark.target_layer_ids) * graphed.drafter.config.hidden_size
    # contexts of 3, 128 and 61 positions: the graph pads all to 128, the eager forward to the longest (128,
    # or 61 when the 128 one is not asked): float sums differ in the last bits, the drafts must not
    for index, count in enumerate((3, 128, 61)):
        features = torch.randn(count, width, generator=torch.Generator().manual_seed(40 + index))
        segment = m.FeatureSegment(f"q{index}", 0, count, 0, tuple(range(count)))
        message = m.TargetFeatures(step_id=0, segments=(segment,), features=features)
        graphed.add_features(message)
        eager.add_features(message)
    return graphed, eager


def _slots(temperature: float) -> tuple[m.DraftSlot, ...]:
    lengths = (3, 128, 61)
    if temperature == 0:
        return tuple(m.DraftSlot(f"q{i}", 5, (60 + i,), n) for i, n in enumerate(lengths))
    return tuple(m.DraftSlot(f"q{i}", 5, (70 + i,), n, temperature=temperature, seed=11 + i, first_output_position=3)
                 for i, n in enumerate(lengths))


@pytest.mark.parametrize("mix", ["greedy", "sampled", "mixed", "one"])
def test_the_graph_path_proposes_what_the_eager_forward_proposes(proposers, mix):
    graphed, eager = proposers
    greedy, sampled = _slots(0.0), _slots(0.8)
    slots = {"greedy": greedy, "sampled": sampled, "mixed": greedy[:1] + sampled[1:], "one": sampled[2:]}[mix]
    request = m.DraftRequest(step_id=1, slots=slots)
    replays = graphed.graphs.num_replays
    got, want = graphed.propose(request), eager.propose(request)
    assert graphed.graphs.num_replays == replays + 1
    for left, right in zip(got.proposals, want.proposals):
        assert left.token_ids == right.token_ids, left.request_id
        assert left.support_token_ids == right.support_token_ids
        assert all(type(token) is int for ids in left.support_token_ids for token in ids)  # read back packed as fp32
        torch.testing.assert_close(torch.tensor(left.draft_probs), torch.tensor(right.draft_probs), rtol=1e-4,
                                   atol=1e-6)
        torch.testing.assert_close(torch.tensor(left.confidences), torch.tensor(right.confidences), rtol=1e-4,
                                   atol=1e-6)
        for ours, theirs in zip(left.support_probs, right.support_probs):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-6)


def test_more_requests_than_the_largest_bucket_run_eagerly(proposers):
    graphed, _ = proposers
    replays = graphed.graphs.num_replays
    request = m.DraftRequest(step_id=2, slots=_slots(0.0) + tuple(
        m.DraftSlot(f"q{i}", 5, (9,), 3) for i in (0, 1)))  # 5 slots > bucket 4
    assert all(len(p.token_ids) == 5 for p in graphed.propose(request).proposals)
    assert graphed.graphs.num_replays == replays
