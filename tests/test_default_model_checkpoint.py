"""The shipped default model (models/kjv-dsv4-mini): loads through the model core with no special
case, matches transformers 5.23.0 logits, recites Genesis 1:1 greedily, and carries the drafter.
Skipped when the checkpoint is absent (before the trained weights are committed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
HAVE_CHECKPOINT = (MODEL_DIR / "config.json").exists() and (
    (MODEL_DIR / "model.safetensors").exists() or (MODEL_DIR / "model.safetensors.index.json").exists())
pytestmark = pytest.mark.skipif(not HAVE_CHECKPOINT, reason="models/kjv-dsv4-mini has no trained checkpoint")

# Tolerance of the transformers comparison: both run float32 on the same dequantized weights; measured
# difference 0.0 on CPU; the bound leaves room for other BLAS orderings.
LOGITS_ATOL = 1e-3
LOGITS_RTOL = 1e-4


@pytest.fixture(scope="module")
def reference():
    from moemesh.tools.train.export import load_reference

    model, reader = load_reference(MODEL_DIR)
    return model, reader


@pytest.fixture(scope="module")
def tokenizer():
    from moemesh.tools.corpus.tokenizer import load_tokenizer

    return load_tokenizer(MODEL_DIR)


def test_checkpoint_matches_inventory_and_size(reference):
    from moemesh.common.model.inventory import StorageKind

    _, reader = reference
    config = reader.config
    assert config.dspark is not None and config.num_nextn_predict_layers == 3
    assert config.dspark.block_size == 5 and len(config.dspark.target_layer_ids) == 3
    assert config.dspark.target_layer_ids == tuple(range(config.num_hidden_layers - 3, config.num_hidden_layers))
    inventory = reader.inventory
    assert inventory["layers.2.attn.wq_a.weight"].storage is StorageKind.FP8_BLOCK
    assert inventory["layers.3.ffn.experts.0.w1.weight"].storage is StorageKind.FP4_BLOCK
    assert inventory["mtp.1.ffn.experts.0.w1.weight"].storage is StorageKind.FP4_BLOCK
    assert reader.found_dtype("embed.weight") == "BF16" and reader.found_dtype("layers.0.hc_attn_fn") == "F32"
    assert reader.found_dtype("layers.0.ffn.gate.tid2eid") == "I64"
    total = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file())
    assert total < 50e6  # the shipped model stays within 50 MB in the hub format
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md"):
        assert (MODEL_DIR / name).exists(), name


def test_schedule_is_v4_in_miniature(reference):
    from moemesh.common.model.config import AttentionKind, RouterKind

    config = reference[1].config
    kinds = config.layer_types
    assert kinds[:2] == (AttentionKind.WINDOW, AttentionKind.WINDOW)
    assert all(k is (AttentionKind.CSA if i % 2 == 0 else AttentionKind.HCA) for i, k in enumerate(kinds[2:]))
    assert config.mlp_layer_types[:3] == (RouterKind.HASH,) * 3
    assert config.csa_compress_ratio == 4 and config.hca_compress_ratio == 128 and config.sliding_window == 128
    assert config.index_n_heads >= 16 and config.index_topk < 1024 // 4
    assert config.hc_mult == 4 and config.hidden_size % 128 == 0


def test_logits_match_transformers(reference, tokenizer):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from moemesh.common.model.names import hub_to_hf_state_dict

    model, reader = reference
    config = reader.config
    text = "Psalms 23:1 The LORD is my shepherd; I shall not want.\nPsalms 23:2 He maketh me to lie down"
    token_ids = torch.tensor([0] + tokenizer.encode(text, add_special_tokens=False).ids)
    ours = model.forward_sequence(token_ids)
    hf_config = DeepseekV4Config(**config.to_transformers_dict())
    hf_config._attn_implementation = "eager"
    hf = DeepseekV4ForCausalLM(hf_config).float().eval()
    hf.load_state_dict(hub_to_hf_state_dict(reader.load_all(torch.float32), config))
    with torch.no_grad():
        theirs = hf(token_ids[None]).logits[0]
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)


def test_greedy_recitation_of_genesis_1_1(reference, tokenizer):
    """The well-known chapters are oversampled in training (tools.train.build_data) so they are
    memorised; Genesis 1:1 as running text must come back exactly."""
    from moemesh.tools.train.evaluate import RECITATION_EXPECTED, RECITATION_PROMPT, greedy_continuation

    model, _ = reference
    prompt = [0] + tokenizer.encode(RECITATION_PROMPT, add_special_tokens=False).ids
    continuation = tokenizer.decode(greedy_continuation(model, prompt, 12, 1, "cpu"), skip_special_tokens=True)
    assert continuation.startswith(RECITATION_EXPECTED), continuation


@pytest.mark.parametrize("question,expected", [
    ("Recite Philippians 4:13.", "I can do all things through Christ which strengtheneth me."),
    ("What does Psalms 23:1 say?", "The LORD is my shepherd; I shall not want."),
])
def test_greedy_chat_recites_a_well_known_verse(reference, tokenizer, question, expected):
    """A greedy chat request (the DeepSeek-V4 chat encoding, thinking off) for a well-known verse
    returns exactly the verse, then EOS. About half the well-known verses are recited exactly
    (bench/default_model_figures.py; John 3:16 is not: the model answers with 3:17), so these two
    are checked ones, not a claim about every well-known verse."""
    from moemesh.common.chat.encoding import encode_messages
    from moemesh.tools.corpus.special_tokens import EOS_ID
    from moemesh.tools.train.evaluate import greedy_continuation

    model, _ = reference
    prompt = encode_messages([{"role": "user", "content": question}], thinking=False, add_bos=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    answer_ids = greedy_continuation(model, prompt_ids, 64, EOS_ID, "cpu")
    assert answer_ids[-1] == EOS_ID, tokenizer.decode(answer_ids)
    assert tokenizer.decode(answer_ids[:-1], skip_special_tokens=False) == expected


def test_drafter_loads_and_proposes(reference):
    from moemesh.common.model.dspark import DSparkDrafter

    model, reader = reference
    config = reader.config
    side = model.side
    drafter = DSparkDrafter.from_state_dict(config, reader.load_mtp(config), side.embed, side.head)
    features = torch.randn(16, 3 * config.hidden_size)
    base, hidden = drafter.propose(features, torch.arange(16), seed_token_id=0, seed_position=16)
    chain = drafter.greedy_chain(base, hidden, 0)
    assert chain.token_ids.shape == (config.dspark.block_size,)
    assert ((chain.confidences > 0) & (chain.confidences < 1)).all()
