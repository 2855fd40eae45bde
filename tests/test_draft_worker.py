"""The draft worker in-process on the shipped default model: proposals equal the drafter's own
chains on the same features, batching is invisible, sampling is reproducible, widths apply."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from moemesh.common.wire import messages as m
from moemesh.common.drafting.chains import dense_distribution
from moemesh.common.speculation_width import SpeculationConfig, SpeculationMode
from moemesh.common.drafting.proposer import DrafterConfig
from moemesh.services.draft.worker import DraftWorker

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="default model not present")


def make_worker(**kwargs) -> DraftWorker:
    """A loaded draft worker on the default model; sampled requests draw their drafts unless told otherwise."""
    worker = DraftWorker(DrafterConfig(checkpoint_path=str(MODEL), **{"draft_sampling": "sampled", **kwargs}))
    asyncio.run(worker.load())
    return worker


@pytest.fixture(scope="module")
def fixed_worker():
    return make_worker(speculation=SpeculationConfig(SpeculationMode.FIXED, width=5), max_support=None)


def raw_features(worker: DraftWorker, count: int, seed: int) -> torch.Tensor:
    width = len(worker.drafter.dspark.target_layer_ids) * worker.drafter.config.hidden_size
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed))  # [n, F]


def send(worker: DraftWorker, request_id: str, start: int, features: torch.Tensor) -> None:
    segment = m.FeatureSegment(request_id, 0, features.shape[0], start, tuple(range(features.shape[0])))
    assert worker.add_features(m.TargetFeatures(step_id=0, segments=(segment,), features=features)) is None


def test_greedy_proposals_equal_the_drafters_greedy_chain_on_the_same_features(fixed_worker):
    worker, drafter = fixed_worker, fixed_worker.drafter
    contexts = {"a": raw_features(worker, 40, 1), "b": raw_features(worker, 7, 2), "c": raw_features(worker, 200, 3)}
    for request_id, features in contexts.items():
        worker.rings.drop(request_id)
        send(worker, request_id, 0, features)
    slots = tuple(m.DraftSlot(request_id, 5, (11 + index,), features.shape[0])
                  for index, (request_id, features) in enumerate(contexts.items()))
    reply = worker.propose(m.DraftRequest(step_id=9, slots=slots))
    assert reply.step_id == 9 and [p.request_id for p in reply.proposals] == ["a", "b", "c"]
    for index, (request_id, features) in enumerate(contexts.items()):
        num_context = min(features.shape[0], 128)
        positions = torch.arange(features.shape[0] - num_context, features.shape[0])
        base, hidden = drafter.propose(features[-num_context:], positions, 11 + index, features.shape[0])
        chain = drafter.greedy_chain(base, hidden, 11 + index)
        proposal = reply.proposals[index]
        assert proposal.token_ids == tuple(chain.token_ids.tolist())
        expected_probs = chain.probs.gather(1, chain.token_ids[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(proposal.draft_probs), expected_probs, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.tensor(proposal.confidences), chain.confidences, rtol=1e-4, atol=1e-6)
        assert proposal.support_token_ids == ()


def test_greedy_drafting_proposes_a_sampled_request_its_argmax_chain_with_all_of_q_on_each_draft():
    """draft_sampling="greedy" (the serving default): a sampled slot gets the greedy chain's tokens, each with the
    point distribution on it as its q (one support token, probability 1.0), whatever its temperature and seed."""
    greedy = make_worker(speculation=SpeculationConfig(SpeculationMode.FIXED, width=5), draft_sampling="greedy")
    features = raw_features(greedy, 30, 8)
    send(greedy, "t", 0, features)
    proposals = []
    for temperature, seed in ((1.0, 3), (0.7, 11)):
        slot = m.DraftSlot("t", 5, (4,), 30, temperature=temperature, seed=seed, first_output_position=2)
        proposals.append(greedy.propose(m.DraftRequest(step_id=1, slots=(slot,))).proposals[0])
    base, hidden = greedy.drafter.propose(features, torch.arange(30), 4, 30)
    chain = greedy.drafter.greedy_chain(base, hidden, 4)
    for proposal in proposals:
        assert proposal.token_ids == tuple(chain.token_ids.tolist())
        assert proposal.support_token_ids == tuple((token,) for token in proposal.token_ids)
        assert proposal.support_probs == ((1.0,),) * 5 and proposal.draft_probs == (1.0,) * 5
    with pytest.raises(ValueError, match="draft_sampling='top'"):
        DrafterConfig(draft_sampling="top")


def test_rejected_positions_are_rolled_back_before_drafting(fixed_worker):
    worker = fixed_worker
    features = raw_features(worker, 30, 4)
    for request_id, count in (("clean", 20), ("stale", 30)):
        worker.rings.drop(request_id)
        send(worker, request_id, 0, features[:count])
    # "stale" also holds features of positions 20..29 (drafts that were rejected): the seed at 20
    # must see exactly what "clean" sees
    slots = (m.DraftSlot("clean", 5, (5,), 20), m.DraftSlot("stale", 5, (5,), 20))
    clean, stale = worker.propose(m.DraftRequest(step_id=1, slots=slots)).proposals
    assert clean.token_ids == stale.token_ids and clean.confidences == pytest.approx(stale.confidences)
    assert worker.rings.ring("stale").next_position == 20
    # a seed later than the context changes the proposal (the context matters)
    other = worker.propose(m.DraftRequest(step_id=2, slots=(m.DraftSlot("other", 5, (5,), 20),))).proposals[0]
    assert other.confidences != pytest.approx(clean.confidences)


def test_sampled_proposals_are_reproducible_and_match_sampled_chain(fixed_worker):
    worker, drafter = fixed_worker, fixed_worker.drafter
    features = raw_features(worker, 25, 5)
    worker.rings.drop("s")
    send(worker, "s", 0, features)

    def sampled(seed: int) -> m.DraftProposal:
        slot = m.DraftSlot("s", 5, (3, 9), 24, temperature=1.0, seed=seed, first_output_position=12)
        return worker.propose(m.DraftRequest(step_id=0, slots=(slot,))).proposals[0]

    first, again = sampled(1234), sampled(1234)
    assert first == again
    assert len({sampled(seed).token_ids for seed in range(6)}) > 1  # the seed matters
    base, hidden = drafter.propose(features, torch.arange(25), 9, 25)  # seed token 9 at position 25
    chain = drafter.sampled_chain(base, hidden, 9, temperature=1.0, seed=1234, output_positions=range(12, 17))
    assert first.token_ids == tuple(chain.token_ids.tolist())
    vocab = drafter.config.vocab_size
    for k, token in enumerate(first.token_ids):  # the full-support q is the drafter's distribution
        q = dense_distribution(first.support_token_ids[k], first.support_probs[k], vocab)
        torch.testing.assert_close(q, chain.probs[k], rtol=1e-4, atol=1e-7)
        assert q[token] == pytest.approx(first.draft_probs[k])


def test_sparse_support_is_exact_and_small():
    worker = make_worker(speculation=SpeculationConfig(SpeculationMode.FIXED, width=4), max_support=16)
    send(worker, "s", 0, raw_features(worker, 10, 6))
    slot = m.DraftSlot("s", 5, (3,), 10, temperature=0.8, seed=7, first_output_position=0)
    proposal = worker.propose(m.DraftRequest(step_id=0, slots=(slot,))).proposals[0]
    assert len(proposal.token_ids) == 4 and len(proposal.support_token_ids) == 4
    for k, token in enumerate(proposal.token_ids):
        ids, probs = proposal.support_token_ids[k], proposal.support_probs[k]
        assert len(ids) == 16 and token in ids and sum(probs) == pytest.approx(1.0, abs=1e-5)
        q = dense_distribution(ids, probs, worker.drafter.config.vocab_size)
        assert float(q[token]) == proposal.draft_probs[k]  # float32 values survive exactly
    # the wire round trip keeps every value bit for bit
    from moemesh.common.wire.codec import decode, encode

    reply = m.DraftTokens(step_id=0, proposals=(proposal,))
    assert decode(encode(reply)) == reply


def test_width_policy_and_slot_caps_cut_the_block():
    adaptive = make_worker(speculation=SpeculationConfig(SpeculationMode.ADAPTIVE, width=5, survival_threshold=0.999))
    fixed = make_worker(speculation=SpeculationConfig(SpeculationMode.FIXED, width=3))
    off = make_worker(speculation=SpeculationConfig(SpeculationMode.OFF))
    for worker in (adaptive, fixed, off):
        send(worker, "r", 0, raw_features(worker, 12, 7))
    slots = (m.DraftSlot("r", 5, (4,), 12), m.DraftSlot("capped", 2, (4,), 0), m.DraftSlot("none", 0, (4,), 0))
    got = {name: worker.propose(m.DraftRequest(step_id=0, slots=slots)).proposals
           for name, worker in (("adaptive", adaptive), ("fixed", fixed), ("off", off))}
    assert [len(p.token_ids) for p in got["fixed"]] == [3, 2, 0]
    assert [len(p.token_ids) for p in got["off"]] == [0, 0, 0]
    full = got["fixed"][0]
    # a threshold of 0.999 keeps only the forced minimum of one draft (the heads are not that sure)
    assert max(full.confidences) < 0.999 and [len(p.token_ids) for p in got["adaptive"]] == [1, 1, 0]
    assert got["adaptive"][0].token_ids == full.token_ids[:1]


def test_refused_inputs():
    worker = make_worker()
    reply = asyncio.run(worker.handle(m.DraftRequest(step_id=0, slots=(m.DraftSlot("x", 3, (1,), 0, temperature=1.0),))))
    assert isinstance(reply, m.ErrorReply) and reply.code is m.ErrorCode.MALFORMED and reply.request_id == "x"
    with pytest.raises(ValueError, match="expected"):
        worker.add_features(m.TargetFeatures(step_id=0, segments=(), features=torch.zeros(2, 5)))
    with pytest.raises(ValueError, match="7 exceeds the drafter's block size"):
        make_worker(speculation=SpeculationConfig(SpeculationMode.FIXED, width=7))
    # finished requests lose their rings
    send(worker, "done", 0, raw_features(worker, 3, 8))
    asyncio.run(worker.handle(m.DraftRequest(step_id=1, slots=(), finished_request_ids=("done",))))
    assert "done" not in worker.rings
