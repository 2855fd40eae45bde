"""Tiny hub-format configurations and random hub-named weights for the tests (docs/model.md §7.2-7.3).

FP8 dims are multiples of 128 or at most 128 (the block size is inferred from the scale grid),
FP4 expert input dims multiples of 32, >= 16 indexer heads (no top-k ties), every path present:
window-only + hash router, CSA (overlapping, with indexer) + hash, HCA at ratio 8, CSA + learned.
"""

from __future__ import annotations

from typing import Any

import torch

from moemesh.common.model.inventory import ParamGroup, StorageKind, TensorSpec, tensor_inventory
from moemesh.common.model.config import ModelConfig


def tiny_hub_config_dict(**overrides: Any) -> dict[str, Any]:
    """Hub `config.json` form of the tiny model; keyword overrides replace keys."""
    config: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "compress_ratios": [0, 4, 128, 4],
        "compress_rate_hca": 8,
        "num_hash_layers": 2,
        "sliding_window": 8,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 2,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1024,
        "num_nextn_predict_layers": 0,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
        "expert_dtype": "fp4",
    }
    config.update(overrides)
    return config


def tiny_config(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict(tiny_hub_config_dict(**overrides))


def _random_tensor(spec: TensorSpec, config: ModelConfig, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Non-degenerate values: what transformers zero-initialises (sinks, bias, ape, HC base) is random."""
    shape = spec.shape
    stem = spec.name.removesuffix(".weight").rsplit(".", 1)[-1]  # e.g. "kv_norm", "wq_a", "ape"

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std + mean).to(dtype)

    if spec.storage is StorageKind.I64:  # tid2eid: distinct experts per token
        rows = [torch.randperm(config.n_routed_experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).to(torch.int64)
    name = spec.name
    if spec.group is ParamGroup.HC or "hc_" in name:
        if name.endswith("_fn"):
            return normal(0.02)
        if name.endswith("_base"):
            return normal(0.5)
        return normal(0.1, mean=1.0)  # scale
    if name.endswith("attn_sink"):
        return normal(0.5)
    if name.endswith("gate.bias"):
        return normal(0.01)
    if name.endswith(".ape"):
        return normal(0.1)
    if "norm" in stem:
        return normal(0.1, mean=1.0)
    if name == "embed.weight":
        return normal(1.0)
    if len(shape) == 2:  # linears: keep activations O(1)
        return normal(shape[1] ** -0.5)
    return normal(0.02)


def random_hub_state_dict(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                          include_mtp: bool = True) -> dict[str, torch.Tensor]:
    """A full random float state dict in hub names (ints for `tid2eid`), for the tests."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: _random_tensor(spec, config, gen, dtype)
        for name, spec in tensor_inventory(config).items()
        if include_mtp or not spec.is_mtp
    }
