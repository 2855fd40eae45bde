"""Tiny DeepSeek-V4 models for tests and examples (docs/model.md §7.1), and the transformers oracle.

`tiny_config()` exercises every path: window-only + hash routing, overlapping CSA with real top-k,
HCA, shared expert, 4 HC streams with Sinkhorn, YaRN. `random_hub_state_dict()` builds
transformers' `DeepseekV4ForCausalLM` from a seed, randomises what transformers zero-initialises
(docs/model.md §7.4: tid2eid, sinks, gate bias, ape, HC base/scale) and returns hub-named tensors, so our
model and the oracle run the same weights. transformers is imported only inside these functions.
"""

from __future__ import annotations

from typing import Any

import torch

from moemesh.common.model.config import ModelConfig, RouterKind
from moemesh.common.model.names import hf_to_hub_state_dict

_EXPERT_NAME_PARTS = ".ffn.experts."


def tiny_config_dict(**overrides: Any) -> dict[str, Any]:
    """transformers-style dict of the docs/model.md §7.1 model (≈ 0.4 M params)."""
    d: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=8, index_n_heads=16,
        index_head_dim=16, index_topk=2, hc_mult=4, hc_sinkhorn_iters=20,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1},
        rope_theta=10000, compress_rope_theta=160000, max_position_embeddings=1024, num_nextn_predict_layers=0,
    )
    d.update(overrides)
    return d


def tiny_config(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config_dict(**overrides))


def build_hf_model(config: ModelConfig, seed: int):
    """transformers DeepseekV4ForCausalLM in fp32 with every inert-by-default path randomised."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    hf_config = DeepseekV4Config(**config.to_transformers_dict())
    hf_config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(hf_config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.gate.tid2eid"):  # distinct random experts per token
                perms = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)
                                     for _ in range(tensor.shape[0])])
                tensor.copy_(perms[:, : tensor.shape[1]])
            elif name.endswith("self_attn.sinks"):
                tensor.normal_(0.0, 0.5, generator=generator)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.01, generator=generator)
            elif name.endswith("position_bias"):
                tensor.normal_(0.0, 0.1, generator=generator)
            elif name.endswith((".base", "hc_base")):
                tensor.normal_(0.0, 0.5, generator=generator)
            elif name.endswith((".scale", "hc_scale")):
                tensor.copy_(1.0 + 0.5 * torch.rand(tensor.shape, generator=generator))
            elif name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=generator))
    return model


def split_hub_state_dict(hub_sd: dict[str, torch.Tensor], config: ModelConfig
                         ) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int], tuple[torch.Tensor, ...]]]:
    """hub tensors -> (attention-side tensors, {(layer, expert): (w1, w2, w3)})."""
    attention = {name: t for name, t in hub_sd.items() if _EXPERT_NAME_PARTS not in name and not name.startswith("mtp.")}
    experts = {}
    for layer in range(config.num_hidden_layers):
        for expert in range(config.n_routed_experts):
            prefix = f"layers.{layer}.ffn.experts.{expert}."
            if prefix + "w1.weight" in hub_sd:
                experts[(layer, expert)] = tuple(hub_sd[prefix + f"{w}.weight"].contiguous() for w in ("w1", "w2", "w3"))
    return attention, experts


def random_hub_state_dict(config: ModelConfig, seed: int) -> tuple[dict[str, torch.Tensor], Any]:
    """(hub-named state dict, the transformers model it came from)."""
    model = build_hf_model(config, seed)
    return hf_to_hub_state_dict(model.state_dict(), config), model


def num_hash_layers(config: ModelConfig) -> int:
    return sum(1 for kind in config.mlp_layer_types if kind is RouterKind.HASH)
