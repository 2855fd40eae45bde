"""Tensor names: official hub checkpoint <-> transformers 5.23.0 `DeepseekV4ForCausalLM.state_dict()`.

Hub names (docs/model.md §4.2, §5.1) have no `model.` prefix and keep routed experts one tensor per expert
(`layers.3.ffn.experts.17.w1.weight`); transformers fuses them per layer into
`mlp.experts.gate_up_proj [E, 2I, D]` (w1 rows, then w3 rows) and `mlp.experts.down_proj [E, D, I]`.
Our own modules use the hub names, so `hf_to_hub_state_dict` is how transformers weights reach them.

Only plain (dequantized) weights are mapped here; FP8/FP4 `.scale` tensors belong to the checkpoint
reader. `mtp.*` has no transformers counterpart (transformers ignores it).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from moemesh.common.model.config import ModelConfig

# (hub suffix inside a layer, transformers suffix inside a layer); order matters only for readability.
_LAYER_PAIRS: tuple[tuple[str, str], ...] = (
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
)
_TOP_PAIRS: tuple[tuple[str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
)
_HUB_TO_HF_LAYER = dict(_LAYER_PAIRS)
_HF_TO_HUB_LAYER = {hf: hub for hub, hf in _LAYER_PAIRS}
_HUB_TO_HF_TOP = dict(_TOP_PAIRS)
_HF_TO_HUB_TOP = {hf: hub for hub, hf in _TOP_PAIRS}

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HUB_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HUB_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_HF_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class UnknownTensorName(KeyError):
    """A tensor name with no counterpart in the other naming scheme."""


def hf_name_to_hub(name: str) -> str:
    """transformers name -> hub name, for every tensor except the fused routed experts."""
    if name in _HF_TO_HUB_TOP:
        return _HF_TO_HUB_TOP[name]
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _HF_TO_HUB_LAYER:
        return f"layers.{match.group(1)}.{_HF_TO_HUB_LAYER[match.group(2)]}"
    raise UnknownTensorName(f"no hub name for transformers tensor {name!r}")


def hub_name_to_hf(name: str) -> str:
    """hub name -> transformers name, for every tensor except per-expert routed weights."""
    if name in _HUB_TO_HF_TOP:
        return _HUB_TO_HF_TOP[name]
    match = _HUB_LAYER.match(name)
    if match and match.group(2) in _HUB_TO_HF_LAYER:
        return f"model.layers.{match.group(1)}.{_HUB_TO_HF_LAYER[match.group(2)]}"
    raise UnknownTensorName(f"no transformers name for hub tensor {name!r}")


def expert_hub_name(layer: int, expert: int, which: str) -> str:
    """`which` is 'w1' (gate), 'w2' (down) or 'w3' (up)."""
    return f"layers.{layer}.ffn.experts.{expert}.{which}.weight"


def hf_to_hub_state_dict(hf_sd: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename every tensor and split fused experts: gate_up [E, 2I, D] -> w1 = rows :I, w3 = rows I:;
    down [E, D, I] -> w2. Tensors are views of the input (no copies)."""
    inter = config.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_sd.items():
        match = _HF_LAYER.match(name)
        if match and match.group(2) in _HF_FUSED:
            layer = int(match.group(1))
            if tensor.shape[0] != config.n_routed_experts:
                raise ValueError(f"{name} has {tensor.shape[0]} experts, config says {config.n_routed_experts}")
            for expert in range(tensor.shape[0]):
                if match.group(2) == "mlp.experts.gate_up_proj":  # [E, 2I, D]
                    out[expert_hub_name(layer, expert, "w1")] = tensor[expert, :inter]
                    out[expert_hub_name(layer, expert, "w3")] = tensor[expert, inter:]
                else:  # down_proj [E, D, I]
                    out[expert_hub_name(layer, expert, "w2")] = tensor[expert]
            continue
        out[hf_name_to_hub(name)] = tensor
    return out


def hub_to_hf_state_dict(hub_sd: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_hub_state_dict`; per-expert tensors are stacked (every expert of a layer
    must be present). `mtp.*` tensors are skipped, as transformers does."""
    import torch

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hub_sd.items():
        if name.startswith("mtp."):
            continue
        match = _HUB_EXPERT.match(name)
        if match:
            layer, expert, which = int(match.group(1)), int(match.group(2)), match.group(3)
            experts.setdefault((layer, which), {})[expert] = tensor
            continue
        out[hub_name_to_hf(name)] = tensor
    layers = sorted({layer for layer, _ in experts})
    for layer in layers:
        parts = {}
        for which in ("w1", "w2", "w3"):
            by_expert = experts.get((layer, which), {})
            missing = [e for e in range(config.n_routed_experts) if e not in by_expert]
            if missing:
                raise ValueError(f"layer {layer} {which}: experts {missing[:8]} missing")
            parts[which] = torch.stack([by_expert[e] for e in range(config.n_routed_experts)])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([parts["w1"], parts["w3"]], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = parts["w2"]
    return out
