"""Built-in model configs: the planner works without a checkpoint (`--preset v4-flash`), and random
layers at true width start from them (`random_init.flash_config`).

Values are the DeepSeek-V4-Flash hub `config.json` (docs/model.md §1.1); only what shapes the
tensor inventory matters to the planner, but the whole config is given so it validates as usual.
"""

from __future__ import annotations

from typing import Any

_FLASH_COMPRESS_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]  # 43 main layers + the MTP entry


def v4_flash_hub_dict() -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
        "num_hash_layers": 3, "num_attention_heads": 64, "num_key_value_heads": 1, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512,
        "qk_rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "compress_ratios": list(_FLASH_COMPRESS_RATIOS), "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
        "max_position_embeddings": 1048576, "topk_method": "noaux_tc", "norm_topk_prob": True,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
        "expert_dtype": "fp4",
    }


PRESETS = {"v4-flash": v4_flash_hub_dict}


def preset_config(name: str):
    """The ModelConfig of a built-in preset."""
    from moemesh.common.model.config import ModelConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return ModelConfig.from_dict(PRESETS[name]())
