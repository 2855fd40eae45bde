"""Continuing training from an exported hub checkpoint (`--init-from DIR`).

The checkpoint is the only state that travels between training runs: its FP8 / FP4 tensors are
dequantised into the trainable target and drafter (the quantisation-aware training of
`tools.train.quant_shadow` keeps them exactly representable, so nothing is lost but the optimizer
state). The model config comes from the checkpoint; a checkpoint without `mtp.*` tensors gives a
freshly initialised drafter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.model.config import ModelConfig


def read_config(path: Path) -> ModelConfig:
    return CheckpointReader(path).config


@torch.no_grad()
def load_target(target, path: Path) -> None:
    """Attention side and routed experts of `path` into a `TrainableTarget` of the same config."""
    reader = CheckpointReader(path)
    config = target.config
    side = reader.load_attention_side(config, torch.float32)
    missing, unexpected = target.side.load_state_dict(side, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: attention side does not match the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    pairs = [(layer, e) for layer in range(config.num_hidden_layers) for e in range(config.n_routed_experts)]
    for (layer, e), (w1, w2, w3) in reader.load_experts(config, pairs, torch.float32).items():
        target.experts.w1[layer][e].copy_(w1)
        target.experts.w2[layer][e].copy_(w2)
        target.experts.w3[layer][e].copy_(w3)


def has_drafter(path: Path) -> bool:
    reader = CheckpointReader(path)
    try:
        reader.load_mtp(reader.config)
    except Exception:  # noqa: BLE001 (any missing or unreadable mtp.* entry: train the drafter fresh)
        return False
    return True


@torch.no_grad()
def load_drafter(trainable, path: Path) -> None:
    """`mtp.*` of `path` into a `TrainableDrafter` (stage weights and stacked routed experts)."""
    reader = CheckpointReader(path)
    config = trainable.drafter.config
    tensors = reader.load_mtp(config, torch.float32)
    stage_state = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if len(parts) == 7 and parts[2:4] == ["ffn", "experts"]:  # mtp.{j}.ffn.experts.{e}.w1.weight
            stage, expert, kind = int(parts[1]), int(parts[4]), parts[5]
            getattr(trainable.experts, kind)[stage][expert].copy_(tensor)
        else:
            stage_state[name] = tensor
    missing, unexpected = trainable.drafter.load_state_dict(stage_state, strict=False)
    missing = [m for m in missing if not m.startswith(("embed.", "head."))]  # shared with the target
    if missing or unexpected:
        raise ValueError(f"{path}: drafter does not match the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
