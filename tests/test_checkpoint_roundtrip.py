"""Hub-format round trip: our writer -> our reader and transformers' FP8 loader (docs/model.md §7.3)."""

from __future__ import annotations

import json

import pytest
import torch

from moemesh.common.model.inventory import tensor_inventory
from moemesh.common.checkpoint.quant import dequantize_fp4, dequantize_fp8_block, quantize_fp4, quantize_fp8_block
from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.model.names import hf_to_hub_state_dict, hub_to_hf_state_dict


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = tiny_config()
    state = random_hub_state_dict(config, seed=7)
    path = write_checkpoint(tmp_path_factory.mktemp("tiny_hub"), config, state,
                            generation_config={"temperature": 1.0, "top_p": 1.0})
    return config, state, path


def _expected_value(spec, tensor: torch.Tensor) -> torch.Tensor:
    """What our format should give back for a float tensor: quantize-dequantize or dtype rounding."""
    if spec.storage.value == "fp8":
        return dequantize_fp8_block(*quantize_fp8_block(tensor, spec.block_size), torch.float32, spec.block_size)
    if spec.storage.value == "fp4":
        return dequantize_fp4(*quantize_fp4(tensor), torch.float32)
    if spec.storage.value == "bf16":
        return tensor.to(torch.bfloat16).float()
    if spec.storage.value == "i64":
        return tensor
    return tensor.float()


def test_written_files_and_config(tiny):
    config, _, path = tiny
    assert (path / "model.safetensors").exists()
    hub_config = json.loads((path / "config.json").read_text())
    assert hub_config["compress_ratios"] == [0, 4, 128, 4]
    assert hub_config["quantization_config"]["weight_block_size"] == [128, 128]
    assert json.loads((path / "generation_config.json").read_text())["top_p"] == 1.0
    reader = CheckpointReader(path)
    assert reader.config == config
    assert reader.report.ok
    assert reader.found_dtype("layers.0.attn.wq_a.weight") == "F8_E4M3"
    assert reader.found_dtype("layers.0.attn.wq_a.scale") == "F8_E8M0"
    assert reader.found_dtype("layers.0.ffn.experts.0.w1.weight") == "I8"
    assert reader.found_dtype("layers.0.ffn.gate.tid2eid") == "I64"
    assert reader.found_dtype("layers.1.attn.compressor.ape") == "F32"
    assert reader.found_dtype("layers.1.attn.indexer.weights_proj.weight") == "BF16"


def test_our_reader_returns_quantized_values(tiny):
    config, state, path = tiny
    reader = CheckpointReader(path)
    loaded = reader.load_all(torch.float32)
    inventory = tensor_inventory(config)
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], _expected_value(inventory[name], tensor)), name
    # quantization is lossy but close: a check that we did not e.g. swap nibbles or blocks
    w1 = state["layers.2.ffn.experts.5.w1.weight"]
    assert (loaded["layers.2.ffn.experts.5.w1.weight"] - w1).abs().max() < 0.35 * w1.abs().max()
    assert loaded["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert loaded["layers.0.attn.wq_a.weight"].dtype == torch.float32
    assert reader.load("layers.0.attn.wq_a.weight", torch.bfloat16).dtype == torch.bfloat16


def test_transformers_loads_identical_weights(tiny):
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    config, _, path = tiny
    model = DeepseekV4ForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True))
    theirs = hf_to_hub_state_dict(model.float().state_dict(), config)
    ours = CheckpointReader(path).load_all(torch.float32)
    assert set(theirs) == set(ours)
    for name in ours:
        assert torch.equal(theirs[name].to(ours[name].dtype), ours[name]), name


def test_sharded_checkpoint_reads_the_same(tiny, tmp_path):
    config, state, single = tiny
    sharded = write_checkpoint(tmp_path / "sharded", config, state, max_shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 2 and shard_files[0] == f"model-00001-of-{len(shard_files):05d}.safetensors"
    assert not (sharded / "model.safetensors").exists()
    a, b = CheckpointReader(single).load_all(), CheckpointReader(sharded).load_all()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_save_pretrained_named_checkpoint(tiny, tmp_path):
    """transformers' own save format (model. prefix, embed_tokens, hc_head.hc_fn, attn.norm)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config, _, path = tiny
    ours = CheckpointReader(path).load_all(torch.float32)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config.to_transformers_dict()))
    model.load_state_dict(hub_to_hf_state_dict(ours, config))
    model.save_pretrained(tmp_path / "saved")
    reader = CheckpointReader(tmp_path / "saved")
    assert not reader.hub_named and reader.report.ok
    assert reader.config.fp8_block_size is None
    again = reader.load_all(torch.float32)
    assert again.keys() == ours.keys()
    for name in ours:
        assert torch.equal(again[name], ours[name]), name
    experts = reader.load_experts(None, [(3, 6)])
    assert torch.equal(experts[(3, 6)][1], ours["layers.3.ffn.experts.6.w2.weight"])


def _reference_logits(path, token_ids: torch.Tensor) -> torch.Tensor:
    from moemesh.common.model.attention_side import AttentionSide
    from moemesh.common.model.moe import RoutedExperts
    from moemesh.common.model.reference import ReferenceModel

    reader = CheckpointReader(path)
    config = reader.config
    pairs = [(layer, expert) for layer in range(config.num_hidden_layers) for expert in range(config.n_routed_experts)]
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config, torch.float32))
    model = ReferenceModel(side, RoutedExperts.from_config(reader.load_experts(config, pairs), config))
    return model.forward_sequence(token_ids)


def test_reference_logits_match_transformers_on_checkpoint_weights(tiny):
    """Our reader + reference model vs transformers holding the same dequantized weights (48 tokens:
    > 5x the window of 8 and the HCA ratio of 8, CSA top-2 of up to 12 rows)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config, _, path = tiny
    token_ids = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(0))
    ours = _reference_logits(path, token_ids)
    hf_config = DeepseekV4Config(**config.to_transformers_dict())
    hf_config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(hf_config).float().eval()
    model.load_state_dict(hub_to_hf_state_dict(CheckpointReader(path).load_all(torch.float32), config))
    with torch.no_grad():
        theirs = model(token_ids[None]).logits[0]
    assert theirs.abs().max() > 0.5  # non-degenerate
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_reference_logits_match_transformers_from_pretrained(tiny):
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    config, _, path = tiny
    token_ids = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    model = DeepseekV4ForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                  attn_implementation="eager").float().eval()
    with torch.no_grad():
        theirs = model(token_ids[None]).logits[0]
    torch.testing.assert_close(_reference_logits(path, token_ids), theirs, rtol=1e-4, atol=1e-4)
