"""The attention/experts split (bit-exact across holders) and exact rollback of decode state."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.moe import ExpertNotHeld, MultiHolderExperts, RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.model.state import RollbackError
from moemesh.bench.checks.tiny_model import random_hub_state_dict, split_hub_state_dict, tiny_config

TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def parts():
    config = tiny_config()
    hub_sd, _ = random_hub_state_dict(config, seed=77)
    attention_sd, experts = split_hub_state_dict(hub_sd, config)
    side = AttentionSide.from_state_dict(config, attention_sd)
    tokens = torch.randint(0, config.vocab_size, (64,), generator=torch.Generator().manual_seed(5))
    return config, side, experts, tokens


def test_experts_on_three_holders_equal_one_holder_bit_for_bit(parts):
    config, side, experts, tokens = parts
    monolithic = ReferenceModel(side, RoutedExperts.from_config(experts, config))
    pairs = sorted(experts)
    holders = [RoutedExperts.from_config({p: experts[p] for p in pairs[k::3]}, config) for k in range(3)]
    split = ReferenceModel(side, MultiHolderExperts(holders))
    assert torch.equal(split.forward_sequence(tokens), monolithic.forward_sequence(tokens))
    # and in decode: prefill + a few single-token steps
    states = [monolithic.new_sequence(), split.new_sequence()]
    for model, state in zip((monolithic, split), states):
        model.forward(tokens[:40], [SequenceChunk(state, 40)])
    for pos in range(40, 46):
        a = monolithic.forward(tokens[pos:pos + 1], [SequenceChunk(states[0], 1)])
        b = split.forward(tokens[pos:pos + 1], [SequenceChunk(states[1], 1)])
        assert torch.equal(a, b)


def test_holder_raises_for_experts_it_does_not_hold(parts):
    config, side, experts, _ = parts
    holder = RoutedExperts.from_config({p: w for p, w in experts.items() if p[1] != 3}, config)
    hidden = torch.randn(2, config.hidden_size)
    ids = torch.tensor([[0, 3], [1, 2]])
    weights = torch.ones(2, 2)
    with pytest.raises(ExpertNotHeld):
        holder(1, hidden, ids, weights)
    mask = holder.held_mask(1, ids)
    assert mask.tolist() == [[True, False], [True, True]]
    out = holder.per_expert_outputs(1, hidden, ids, weights, slot_mask=mask)
    assert torch.count_nonzero(out[0, 1]) == 0 and torch.count_nonzero(out[0, 0]) > 0
    with pytest.raises(ExpertNotHeld):
        MultiHolderExperts([holder])(1, hidden, ids, weights)


def test_routed_sum_matches_dense_formula(parts):
    """RoutedExperts = Σ_k g_k · w2(silu(min(w1 x, L)) · clamp(w3 x, ±L)) for the chosen experts."""
    config, _, experts, _ = parts
    holder = RoutedExperts.from_config(experts, config)
    hidden = torch.randn(3, config.hidden_size) * 5
    ids = torch.tensor([[0, 5], [2, 7], [1, 5]])
    weights = torch.rand(3, 2)
    expected = torch.zeros(3, config.hidden_size)
    limit = config.swiglu_limit
    for t in range(3):
        for k in range(2):
            w1, w2, w3 = experts[(2, int(ids[t, k]))]
            a = (w1 @ hidden[t]).clamp(max=limit)
            u = (w3 @ hidden[t]).clamp(-limit, limit)
            expected[t] += weights[t, k] * (w2 @ (torch.nn.functional.silu(a) * u))
    assert (holder(2, hidden, ids, weights) - expected).abs().max() < 1e-5


def _decode(model, state, tokens):
    return torch.cat([model.forward(tokens[i:i + 1], [SequenceChunk(state, 1)]) for i in range(len(tokens))])


def _assert_same_state(a, b, exact=True):
    left, right = a.live_tensors(), b.live_tensors()
    assert set(left) == set(right)
    for name in left:
        if exact:
            assert torch.equal(left[name], right[name]), name
        else:
            assert left[name].shape == right[name].shape, name
            assert (left[name] - right[name]).abs().max() < 1e-5, name


@pytest.mark.parametrize("prefill", [29, 30, 31, 37])
def test_rollback_restores_state_and_logits(parts, prefill):
    """Decode 8 tokens across CSA (ratio 4) and HCA (ratio 8) window closes, roll back, decode again."""
    config, side, experts, tokens = parts
    model = ReferenceModel(side, RoutedExperts.from_config(experts, config))
    state = model.new_sequence(max_rollback_tokens=8)
    model.forward(tokens[:prefill], [SequenceChunk(state, prefill)])
    before = state.clone()
    draft = tokens[prefill:prefill + 8]
    first = _decode(model, state, draft)
    state.rollback(8)
    assert state.num_tokens == prefill
    _assert_same_state(state, before)
    again = _decode(model, state, draft)
    assert torch.equal(first, again)
    # decode-built state equals prefill-built state up to float rounding (different batch shapes)
    _assert_same_state(state, _prefilled(model, tokens[:prefill + 8]), exact=False)


def _prefilled(model, tokens):
    state = model.new_sequence()
    model.forward(tokens, [SequenceChunk(state, len(tokens))])
    return state


def test_rollback_then_different_tokens_equals_never_seeing_the_rejected_ones(parts):
    """Speculative verification: a multi-token verify step, partial rejection, then continue."""
    config, side, experts, tokens = parts
    model = ReferenceModel(side, RoutedExperts.from_config(experts, config))
    state = model.new_sequence(max_rollback_tokens=8)
    model.forward(tokens[:33], [SequenceChunk(state, 33)])
    rejected = torch.randint(0, config.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    model.forward(torch.cat([tokens[33:35], rejected]), [SequenceChunk(state, 8)])  # verify 8 at once
    state.rollback(6)  # first two accepted
    continued = model.forward(tokens[35:45], [SequenceChunk(state, 10)])
    reference = model.forward_sequence(tokens[:45])
    assert (continued - reference[35:45]).abs().max() < TOLERANCE


def test_rollback_limits(parts):
    config, side, experts, tokens = parts
    model = ReferenceModel(side, RoutedExperts.from_config(experts, config))
    state = model.new_sequence(max_rollback_tokens=4)
    model.forward(tokens[:20], [SequenceChunk(state, 20)])
    with pytest.raises(RollbackError):
        state.rollback(5)
    state.rollback(3)
    with pytest.raises(RollbackError):  # 3 + 2 below the high-water mark exceeds 4
        state.rollback(2)
    state.rollback(1)
    assert state.num_tokens == 16
    logits = model.forward(tokens[16:24], [SequenceChunk(state, 8)])
    assert (logits - model.forward_sequence(tokens[:24])[16:24]).abs().max() < TOLERANCE


def test_state_and_batch_validation(parts):
    config, side, experts, tokens = parts
    model = ReferenceModel(side, RoutedExperts.from_config(experts, config))
    state = model.new_sequence()
    with pytest.raises(ValueError, match="only once"):
        model.forward(tokens[:4], [SequenceChunk(state, 2), SequenceChunk(state, 2)])
    with pytest.raises(ValueError, match="token ids"):
        model.forward(tokens[:3], [SequenceChunk(state, 4)])
