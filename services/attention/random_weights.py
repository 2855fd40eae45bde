"""The attention worker's weights from a random-weights model directory (no checkpoint).

See `services.expert.random_weights`: a directory with config.json + random_weights.json. The
attention side is generated on the worker's device in the checkpoint formats
(`common.model.random_init.random_attention_side`: FP8 linears stay FP8, the rest at the activation
dtype), then the spec's routing skew is applied to the gate bias of every learned layer:
bias[e] = -c·ln(1 + rank[e]) (hash layers route by token id and are left alone). The bias takes part
in selection only (spec §2.8), so the routing weights of the chosen experts are unchanged.
"""

from __future__ import annotations

import torch

from services.expert.random_weights import read_random_spec, skew_ranks


def apply_routing_skew(side, config, seed: int, strength: float) -> None:
    """Set every learned gate's bias to -strength·ln(1 + rank) (ranks from `skew_ranks`)."""
    from common.model.config import RouterKind

    if strength <= 0.0:
        return
    for layer in range(config.num_hidden_layers):
        if config.mlp_layer_types[layer] is RouterKind.HASH:
            continue
        gate = side.layers[layer].ffn.gate
        ranks = torch.tensor(skew_ranks(config.n_routed_experts, layer, seed), dtype=torch.float32)
        gate.bias.data.copy_((-strength * torch.log1p(ranks)).to(gate.bias.device, gate.bias.dtype))


def random_attention_side_for(path: str, dtype: torch.dtype, device: torch.device):
    """(ModelConfig, AttentionSide) of the random model at `path`, on `device` at `dtype`."""
    from common.model.config import ModelConfig, NumericsConfig
    from common.model.random_init import random_attention_side

    config = ModelConfig.load(path)
    spec = read_random_spec(path)
    numerics = NumericsConfig(dtype=str(dtype).removeprefix("torch."))
    with torch.no_grad():
        side = random_attention_side(config, numerics, device, seed=spec.seed)
        apply_routing_skew(side, config, spec.seed, spec.routing_skew)
    return config, side
