"""DSpark drafter (common/model/dspark.py) on a tiny random model: shapes, Markov chains, heads,
bidirectional in-block attention, context handling, loss, and the mtp.* checkpoint round trip."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.model.inventory import tensor_inventory
from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.dspark import DSparkDrafter, dspark_loss_terms, slot_weights, target_features

BLOCK = 5
NOISE_ID = 255


def _config():
    return tiny_config(compress_ratios=[0, 4, 128, 4, 0, 0, 0], num_nextn_predict_layers=3, dspark_block_size=BLOCK,
                       dspark_markov_rank=32, dspark_target_layer_ids=[1, 2, 3], dspark_noise_token_id=NOISE_ID)


def _build(config, hub_sd):
    side = AttentionSide.from_state_dict(config, hub_sd)
    return DSparkDrafter.from_state_dict(config, hub_sd, side.embed, side.head)


@pytest.fixture(scope="module")
def tiny():
    config = _config()
    hub_sd = random_hub_state_dict(config, seed=3)
    # the writer's random Markov/confidence weights are small: make the heads matter
    hub_sd["mtp.2.markov_head.markov_w2.weight"] = hub_sd["mtp.2.markov_head.markov_w2.weight"] * 8
    return config, hub_sd, _build(config, hub_sd)


def _context(config, num_positions: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num_positions, 3 * config.hidden_size, generator=gen)
    return features, torch.arange(num_positions)


def test_propose_shapes_and_finite(tiny):
    config, _, drafter = tiny
    features, positions = _context(config, 20)
    base, hidden = drafter.propose(features, positions, seed_token_id=7, seed_position=20)
    assert base.shape == (BLOCK, config.vocab_size) and hidden.shape == (BLOCK, config.hidden_size)
    assert torch.isfinite(base).all() and torch.isfinite(hidden).all()
    assert base.std() > 0.1  # non-degenerate
    empty_base, _ = drafter.propose(features[:0], positions[:0], seed_token_id=7, seed_position=0)  # no context yet
    assert torch.isfinite(empty_base).all() and not torch.allclose(empty_base, base)


def test_greedy_chain_applies_markov_bias_left_to_right(tiny):
    config, _, drafter = tiny
    features, positions = _context(config, 16)
    base, hidden = drafter.propose(features, positions, seed_token_id=11, seed_position=16)
    chain = drafter.greedy_chain(base, hidden, seed_token_id=11)
    head = drafter.mtp[-1].markov_head
    prev = 11
    for k in range(BLOCK):
        bias = head.markov_w2(head.markov_w1(torch.tensor(prev)))
        assert int(chain.token_ids[k]) == int((base[k] + bias).argmax())
        prev = int(chain.token_ids[k])
    # the bias is not a no-op: without it at least one slot would differ or logits differ
    assert not torch.allclose(chain.probs[0], torch.softmax(base[0].float(), -1))


def test_sampled_chain_at_low_temperature_equals_greedy(tiny):
    config, _, drafter = tiny
    for seed_token in (3, 42, 200):
        features, positions = _context(config, 30, seed=seed_token)
        base, hidden = drafter.propose(features, positions, seed_token_id=seed_token, seed_position=30)
        greedy = drafter.greedy_chain(base, hidden, seed_token)
        sampled = drafter.sampled_chain(base, hidden, seed_token, temperature=1e-4, seed=5,
                                        output_positions=range(10, 10 + BLOCK))
        assert torch.equal(greedy.token_ids, sampled.token_ids)
        torch.testing.assert_close(greedy.confidences, sampled.confidences)


def test_sampled_chain_is_seeded_and_distributions_are_exact(tiny):
    config, _, drafter = tiny
    features, positions = _context(config, 12)
    base, hidden = drafter.propose(features, positions, seed_token_id=9, seed_position=12)
    a = drafter.sampled_chain(base, hidden, 9, temperature=1.5, seed=77, output_positions=range(BLOCK))
    b = drafter.sampled_chain(base, hidden, 9, temperature=1.5, seed=77, output_positions=range(BLOCK))
    assert torch.equal(a.token_ids, b.token_ids)
    draws = {tuple(drafter.sampled_chain(base, hidden, 9, temperature=1.5, seed=s,
                                         output_positions=range(BLOCK)).token_ids.tolist()) for s in range(8)}
    assert len(draws) > 1  # different seeds give different drafts
    torch.testing.assert_close(a.probs.sum(-1), torch.ones(BLOCK))
    # each slot's distribution is the tempered Markov-corrected softmax given the drawn prefix
    prev = 9
    for k in range(BLOCK):
        logits, _ = drafter.markov_logits(base[k], torch.tensor(prev))
        torch.testing.assert_close(a.probs[k], torch.softmax(logits / 1.5, -1))
        assert a.probs[k, a.token_ids[k]] > 0
        prev = int(a.token_ids[k])
    assert ((a.confidences > 0) & (a.confidences < 1)).all()
    survival = a.prefix_survival()
    assert (survival[1:] <= survival[:-1]).all()


def test_in_block_attention_is_bidirectional(tiny):
    config, _, drafter = tiny
    features, positions = _context(config, 10)
    main_x = drafter.fuse_features(features)[None]
    valid = torch.ones(1, 10, dtype=torch.bool)
    block_positions = 10 + torch.arange(BLOCK)[None]
    with torch.no_grad():
        a = drafter.block_hidden(main_x, positions[None], valid, torch.tensor([[5] + [NOISE_ID] * 4]), block_positions)
        b = drafter.block_hidden(main_x, positions[None], valid, torch.tensor([[5] + [NOISE_ID] * 3 + [17]]),
                                 block_positions)
    assert (a[0, 0] - b[0, 0]).abs().max() > 1e-4  # slot 0 sees the last slot's token


def test_context_ring_matters_and_invalid_entries_do_not(tiny):
    config, _, drafter = tiny
    features, positions = _context(config, 8)
    main_x = drafter.fuse_features(features)[None]
    inputs = drafter.block_inputs(torch.tensor([4]))
    block_positions = 8 + torch.arange(BLOCK)[None]
    valid = torch.ones(1, 8, dtype=torch.bool)
    with torch.no_grad():
        base = drafter.block_hidden(main_x, positions[None], valid, inputs, block_positions)
        changed = main_x.clone()
        changed[0, 3] += 1.0
        moved = drafter.block_hidden(changed, positions[None], valid, inputs, block_positions)
        masked_valid = valid.clone()
        masked_valid[0, 3] = False
        masked_a = drafter.block_hidden(main_x, positions[None], masked_valid, inputs, block_positions)
        masked_b = drafter.block_hidden(changed, positions[None], masked_valid, inputs, block_positions)
    assert (base - moved).abs().max() > 1e-4
    torch.testing.assert_close(masked_a, masked_b)


def test_batched_blocks_equal_single_blocks(tiny):
    config, _, drafter = tiny
    features, positions = _context(config, 24)
    main_x = drafter.fuse_features(features)
    seeds = torch.tensor([3, 8])
    anchors = [24, 16]
    ctx_pos = torch.stack([torch.arange(a - 8, a) for a in anchors])
    ctx_x = torch.stack([main_x[a - 8:a] for a in anchors])
    valid = torch.ones(2, 8, dtype=torch.bool)
    block_positions = torch.tensor(anchors)[:, None] + torch.arange(BLOCK)[None]
    with torch.no_grad():
        both = drafter.block_hidden(ctx_x, ctx_pos, valid, drafter.block_inputs(seeds), block_positions)
        for i in range(2):
            one = drafter.block_hidden(ctx_x[i:i + 1], ctx_pos[i:i + 1], valid[i:i + 1],
                                       drafter.block_inputs(seeds[i:i + 1]), block_positions[i:i + 1])
            torch.testing.assert_close(both[i], one[0], rtol=1e-5, atol=1e-5)


def test_target_features_average_streams():
    h = [torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3), torch.ones(2, 4, 3)]
    out = target_features(h)
    assert out.shape == (2, 6)
    torch.testing.assert_close(out[:, :3], h[0].mean(dim=1))


def test_dspark_loss_terms():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, BLOCK, 50, generator=gen)
    labels = torch.randint(0, 50, (3, BLOCK), generator=gen)
    weights = slot_weights(BLOCK)[None].expand(3, -1)
    torch.testing.assert_close(weights[0, 1], torch.exp(torch.tensor(-1.0 / BLOCK)))
    same = dspark_loss_terms(logits, logits, labels, torch.full((3, BLOCK), 0.999), weights)
    assert float(same["tv"]) < 1e-6 and float(same["bce"]) < 0.01
    other = dspark_loss_terms(logits, torch.randn(3, BLOCK, 50, generator=gen), labels, torch.full((3, BLOCK), 0.999),
                              weights)
    assert 0.1 < float(other["tv"]) <= 1.0 and float(other["bce"]) > float(same["bce"])
    expected = 0.1 * other["ce"] + 0.9 * other["tv"] + other["bce"]
    torch.testing.assert_close(other["loss"], expected)


def test_inventory_lists_exactly_the_drafter_tensors(tiny):
    config, _, drafter = tiny
    inventory = {name for name, spec in tensor_inventory(config).items() if spec.is_mtp}
    experts = {f"mtp.{j}.ffn.experts.{e}.{w}.weight" for j in range(3) for e in range(config.n_routed_experts)
               for w in ("w1", "w2", "w3")}
    assert set(drafter.state_dict()) | experts == inventory
    assert not any(name.startswith(("embed", "head")) for name in drafter.state_dict())


def test_mtp_checkpoint_round_trip(tiny, tmp_path):
    config, hub_sd, _ = tiny
    first = CheckpointReader(write_checkpoint(tmp_path / "a", config, hub_sd))
    loaded = {**first.load_attention_side(config), **first.load_mtp(config)}
    for j in range(3):
        for e in range(config.n_routed_experts):
            assert f"mtp.{j}.ffn.experts.{e}.w1.weight" in loaded
    pairs = [(layer, e) for layer in range(config.num_hidden_layers) for e in range(config.n_routed_experts)]
    loaded.update({f"layers.{l}.ffn.experts.{e}.{w}.weight": t for (l, e), ws in
                   first.load_experts(config, pairs).items() for w, t in zip(("w1", "w2", "w3"), ws)})
    second = CheckpointReader(write_checkpoint(tmp_path / "b", config, loaded))
    again = second.load_mtp(config)
    for name, tensor in first.load_mtp(config).items():  # quantized values survive a second pass exactly
        assert torch.equal(again[name], tensor), name
    assert (loaded["mtp.0.main_proj.weight"] - hub_sd["mtp.0.main_proj.weight"]).abs().max() < 0.1
    a, b = _build(config, loaded), _build(config, {**loaded, **again})
    features, positions = _context(config, 9)
    base_a, hidden_a = a.propose(features, positions, 1, 9)
    base_b, hidden_b = b.propose(features, positions, 1, 9)
    assert torch.equal(base_a, base_b) and torch.equal(hidden_a, hidden_b)
