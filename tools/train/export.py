"""Export of the trained target + drafter in the hub format, and checks of the exported files.

`export_checkpoint` hands the float hub-named tensors to `common.checkpoint.writer.write_checkpoint`,
which quantizes per the inventory: FP8 e4m3 with 128×128 ue8m0 scales for dense linears, FP4 with
per-32 scales for routed experts (main and `mtp.*`), bf16 embed / head / norms / compressors /
gates, fp32 HC / sink / ape / bias, int64 `tid2eid`. `load_reference` reads it back with the
model core's reader and reference model, no special case.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.checkpoint.writer import write_checkpoint
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.config import ModelConfig, NumericsConfig
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel

GENERATION_CONFIG = {
    "_comment": "sampling defaults of the kjv-dsv4-mini default model",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.9,
}


def export_checkpoint(out_dir: Path, config: ModelConfig, hub_state_dict: dict[str, torch.Tensor],
                      tokenizer_dir: Path | None, max_shard_bytes: int | None = 15_000_000) -> Path:
    """Shards of at most max_shard_bytes (the default keeps every file of the default model under
    16 MiB)."""
    generation = {k: v for k, v in GENERATION_CONFIG.items() if not k.startswith("_")}
    floats = {name: t.detach().float().cpu() if t.is_floating_point() else t.detach().cpu()
              for name, t in hub_state_dict.items()}
    return write_checkpoint(out_dir, config, floats, tokenizer_dir=tokenizer_dir, generation_config=generation,
                            max_shard_bytes=max_shard_bytes)


def load_reference(path: Path, device: torch.device | str = "cpu", dtype: str = "float32"
                   ) -> tuple[ReferenceModel, CheckpointReader]:
    """The exported checkpoint as the model core's single-process reference model."""
    reader = CheckpointReader(path)
    config = reader.config
    numerics = NumericsConfig(dtype)
    torch_dtype = numerics.torch_dtype()
    side_sd = reader.load_attention_side(config, torch_dtype)
    side = AttentionSide.from_state_dict(config, side_sd, numerics, device=device)
    pairs = [(layer, e) for layer in range(config.num_hidden_layers) for e in range(config.n_routed_experts)]
    experts = {key: tuple(w.to(device) for w in ws) for key, ws in reader.load_experts(config, pairs, torch_dtype).items()}
    return ReferenceModel(side, RoutedExperts.from_config(experts, config, numerics)), reader


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())

