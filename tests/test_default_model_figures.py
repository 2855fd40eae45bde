"""The offline figures of the default model (bench/default_model_offline.py) on the shipped
checkpoint: simulated speculation at temperature 0 is lossless (equal to plain greedy decoding)
and routing counts add up. Skipped when the checkpoint is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason="no shipped checkpoint")


@pytest.fixture(scope="module")
def loaded():
    from moemesh.common.model.dspark import DSparkDrafter
    from moemesh.tools.corpus.tokenizer import load_tokenizer
    from moemesh.tools.train.export import load_reference

    model, reader = load_reference(MODEL_DIR)
    config = reader.config
    drafter = DSparkDrafter.from_state_dict(config, reader.load_mtp(config), model.side.embed, model.side.head)
    return model, drafter, load_tokenizer(MODEL_DIR)


def test_greedy_speculation_equals_plain_greedy(loaded):
    from moemesh.bench.default_model_offline import speculative_acceptance
    from moemesh.tools.corpus.special_tokens import BOS_ID, EOS_ID
    from moemesh.tools.train.evaluate import greedy_continuation

    model, drafter, tokenizer = loaded
    prompt = [BOS_ID] + tokenizer.encode("Psalms 23:1 The LORD", add_special_tokens=False).ids
    figure = speculative_acceptance(model, drafter, [prompt], 0.0, 16, EOS_ID, seed=3)
    assert list(figure.outputs[0]) == greedy_continuation(model, prompt, 16, EOS_ID, "cpu")
    assert 0.0 <= figure.mean_accepted <= drafter.dspark.block_size
    assert figure.num_verify_steps <= 16 and len(figure.accepted_per_slot) == drafter.dspark.block_size
    # every verify step emits accepted + 1 tokens (the last step may overshoot max_new_tokens)
    assert figure.num_verify_steps * (1 + figure.mean_accepted) >= 16


def test_sampled_speculation_is_seeded(loaded):
    from moemesh.bench.default_model_offline import speculative_acceptance
    from moemesh.tools.corpus.special_tokens import BOS_ID, EOS_ID

    model, drafter, tokenizer = loaded
    prompt = [BOS_ID] + tokenizer.encode("John 3:16 For God", add_special_tokens=False).ids
    first = speculative_acceptance(model, drafter, [prompt], 1.0, 8, EOS_ID, seed=5)
    again = speculative_acceptance(model, drafter, [prompt], 1.0, 8, EOS_ID, seed=5)
    assert first == again and len(first.outputs[0]) == 8


def test_routing_counts_cover_every_token_slot(loaded):
    from moemesh.bench.default_model_offline import routing_stats

    model, _, tokenizer = loaded
    ids = torch.tensor([0] + tokenizer.encode("In the beginning God created the heaven and the earth.",
                                               add_special_tokens=False).ids)
    stats = routing_stats(model, [ids, ids[:5]])
    config = model.config
    for layer in range(config.num_hidden_layers):
        assert sum(stats.layer_counts(layer)) == (ids.shape[0] + 5) * config.num_experts_per_tok
    skews = stats.skews()
    assert all(1.0 <= s.max_over_mean <= config.n_routed_experts for s in skews)
