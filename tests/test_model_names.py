"""names.py against the keys of a real transformers DeepseekV4ForCausalLM state dict."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.names import (
    UnknownTensorName,
    hf_name_to_hub,
    hf_to_hub_state_dict,
    hub_name_to_hf,
    hub_to_hf_state_dict,
)
from moemesh.bench.checks.tiny_model import build_hf_model, split_hub_state_dict, tiny_config


@pytest.fixture(scope="module")
def hf_and_config():
    config = tiny_config()
    return build_hf_model(config, seed=11), config


def test_every_transformers_key_maps_and_round_trips(hf_and_config):
    model, config = hf_and_config
    hf_sd = model.state_dict()
    hub_sd = hf_to_hub_state_dict(hf_sd, config)
    back = hub_to_hf_state_dict(hub_sd, config)
    assert set(back) == set(hf_sd)
    for name, tensor in hf_sd.items():
        assert torch.equal(back[name], tensor), name


def test_hub_names_are_exactly_our_module_names(hf_and_config):
    model, config = hf_and_config
    hub_sd = hf_to_hub_state_dict(model.state_dict(), config)
    attention_sd, experts = split_hub_state_dict(hub_sd, config)
    ours = AttentionSide(config, device="meta").state_dict()
    assert set(ours) == set(attention_sd)
    assert len(experts) == config.num_hidden_layers * config.n_routed_experts


def test_expert_split_layout(hf_and_config):
    model, config = hf_and_config
    hub_sd = hf_to_hub_state_dict(model.state_dict(), config)
    gate_up = model.model.layers[2].mlp.experts.gate_up_proj  # [E, 2I, D]
    down = model.model.layers[2].mlp.experts.down_proj  # [E, D, I]
    inter = config.moe_intermediate_size
    assert torch.equal(hub_sd["layers.2.ffn.experts.5.w1.weight"], gate_up[5, :inter])
    assert torch.equal(hub_sd["layers.2.ffn.experts.5.w3.weight"], gate_up[5, inter:])
    assert torch.equal(hub_sd["layers.2.ffn.experts.5.w2.weight"], down[5])


@pytest.mark.parametrize(
    ("hf", "hub"),
    [
        ("model.embed_tokens.weight", "embed.weight"),
        ("lm_head.weight", "head.weight"),
        ("model.hc_head.hc_fn", "hc_head_fn"),
        ("model.layers.7.self_attn.compressor.indexer.scorer.weights_proj.weight", "layers.7.attn.indexer.weights_proj.weight"),
        ("model.layers.3.self_attn.compressor.kv_norm.weight", "layers.3.attn.compressor.norm.weight"),
        ("model.layers.0.mlp.gate.e_score_correction_bias", "layers.0.ffn.gate.bias"),
        ("model.layers.1.attn_hc.fn", "layers.1.hc_attn_fn"),
    ],
)
def test_single_names(hf, hub):
    assert hf_name_to_hub(hf) == hub
    assert hub_name_to_hf(hub) == hf


def test_unknown_names_raise():
    with pytest.raises(UnknownTensorName):
        hf_name_to_hub("model.layers.0.self_attn.q_b_norm.weight")
    with pytest.raises(UnknownTensorName):
        hub_name_to_hf("layers.0.attn.wq_a.scale")
