"""The single-process reference model read from a checkpoint: every tensor dequantized, every
routed expert held in this process. For `moemesh generate`, `moemesh check-model --forward` and
the reference runs benchmarks and tests compare against; only for models that fit in memory.
"""

from __future__ import annotations

from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.config import NumericsConfig
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel


def load_reference_model(reader: CheckpointReader, numerics: NumericsConfig, device: str = "cpu") -> ReferenceModel:
    """The attention side and all (layer, expert) pairs of `reader`'s checkpoint in `numerics.dtype` on `device`."""
    config = reader.config
    dtype = numerics.torch_dtype()
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config, dtype), numerics, device=device)
    pairs = [(layer, expert) for layer in range(config.num_hidden_layers) for expert in range(config.n_routed_experts)]
    experts = {pair: tuple(w.to(device) for w in weights)
               for pair, weights in reader.load_experts(config, pairs, dtype).items()}
    return ReferenceModel(side, RoutedExperts.from_config(experts, config, numerics))
