"""ModelConfig: both config forms, the real Flash/Pro configs, and errors that name the key."""

from __future__ import annotations

import json

import pytest

from moemesh.common.model.config import AttentionKind, ConfigError, ModelConfig, NumericsConfig, RouterKind, YarnConfig
from moemesh.bench.checks.tiny_model import tiny_config_dict
from moemesh.common.model.presets import v4_flash_hub_dict

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]  # 43 main layers + MTP entry


def flash_hub_dict() -> dict:
    """The V4-Flash hub config.json values (docs/model.md §1.1), shared with the placement preset."""
    return v4_flash_hub_dict()


def pro_hub_dict() -> dict:
    d = flash_hub_dict()
    d.update(hidden_size=7168, num_hidden_layers=61, n_routed_experts=384, num_attention_heads=128, o_groups=16,
             compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0])
    return d


def test_flash_config_loads_with_its_schedule(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(flash_hub_dict()))
    config = ModelConfig.load(tmp_path)
    assert config.layer_types[:3] == (AttentionKind.WINDOW, AttentionKind.WINDOW, AttentionKind.CSA)
    assert sum(k is AttentionKind.CSA for k in config.layer_types) == 21
    assert sum(k is AttentionKind.HCA for k in config.layer_types) == 20
    assert config.mlp_layer_types[:4] == (RouterKind.HASH,) * 3 + (RouterKind.LEARNED,)
    assert config.compress_ratio(0) is None and config.compress_ratio(2) == 4 and config.compress_ratio(3) == 128
    assert config.yarn == YarnConfig(16.0, 65536, 32.0, 1.0)
    assert config.fp8_block_size == (128, 128) and config.expert_dtype == "fp4"
    assert config.extra_compress_ratios == (0,)
    assert ModelConfig.from_dict(config.to_hub_dict()) == config
    assert config.to_hub_dict()["compress_ratios"] == FLASH_RATIOS


def test_pro_config_loads():
    config = ModelConfig.from_dict(pro_hub_dict())
    assert (config.hidden_size, config.num_hidden_layers, config.n_routed_experts) == (7168, 61, 384)
    assert config.layer_types[:2] == (AttentionKind.HCA, AttentionKind.HCA)


def test_dspark_keys_round_trip():
    d = flash_hub_dict()
    d.update(dspark_block_size=5, dspark_markov_rank=256, dspark_target_layer_ids=[40, 41, 42],
             dspark_noise_token_id=128799, compress_ratios=FLASH_RATIOS + [0, 0])
    config = ModelConfig.from_dict(d)
    assert config.dspark.target_layer_ids == (40, 41, 42) and config.extra_compress_ratios == (0, 0, 0)
    assert ModelConfig.from_dict(config.to_hub_dict()) == config


def test_legacy_and_transformers_forms_are_equal():
    transformers_form = ModelConfig.from_dict(tiny_config_dict())
    legacy = tiny_config_dict()
    for key in ("layer_types", "compress_rates", "mlp_layer_types"):
        del legacy[key]
    legacy.update(compress_ratios=[0, 4, 128, 4], compress_rate_hca=8, num_hash_layers=1)
    assert ModelConfig.from_dict(legacy) == transformers_form
    assert ModelConfig.from_dict(transformers_form.to_transformers_dict()) == transformers_form
    assert ModelConfig.from_dict(transformers_form.to_hub_dict()) == transformers_form


def test_transformers_accepts_our_kwargs_and_agrees():
    from transformers import DeepseekV4Config

    ours = ModelConfig.from_dict(flash_hub_dict())
    theirs = DeepseekV4Config(**ours.to_transformers_dict())
    assert theirs.layer_types == [k.value for k in ours.layer_types]
    assert theirs.qk_rope_head_dim == 64
    assert theirs.rope_parameters["compress"]["rope_type"] == "yarn"
    assert ModelConfig.from_dict(theirs.to_dict()).layer_types == ours.layer_types
    # transformers reading the hub dict directly yields the same architecture
    hub_read = DeepseekV4Config(**{k: v for k, v in flash_hub_dict().items() if k not in ("quantization_config",)})
    assert hub_read.layer_types == theirs.layer_types and hub_read.mlp_layer_types == theirs.mlp_layer_types


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"compress_ratios": FLASH_RATIOS[:5] + [64] + FLASH_RATIOS[6:]}, "compress_ratios[5]=64 is not one of 0, 4, 128"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 must be 1"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type='linear'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method='gptq'"),
        ({"expert_dtype": "int4"}, "expert_dtype='int4'"),
        ({"num_attention_heads": 60}, "not divisible by o_groups"),
        ({"n_shared_experts": 2}, "n_shared_experts=2 must be 1"),
        ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries"),
    ],
)
def test_unsupported_values_name_the_key(change, message):
    d = flash_hub_dict()
    d.update(change)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        ModelConfig.from_dict(d)


def test_bad_layer_type_name_fails():
    with pytest.raises(ConfigError, match=r"layer_types\[1\]='dense'"):
        ModelConfig.from_dict(tiny_config_dict(layer_types=["sliding_attention", "dense", "sliding_attention",
                                                            "sliding_attention"]))


def test_numerics_config_defaults_match_transformers():
    numerics = NumericsConfig()
    assert numerics.dtype == "float32" and numerics.shared_expert_clamp and not numerics.route_weight_before_w2
    with pytest.raises(ConfigError, match="dtype='int8'"):
        NumericsConfig(dtype="int8")


def test_config_and_names_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, moemesh.common.model.config, moemesh.common.model.names, moemesh.common.model.presets, "
            "moemesh.common.model.inventory, moemesh.commands.generate; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
