"""Writing hub-format checkpoints (docs/model.md §4, §7.3).

`write_checkpoint` quantizes a float hub-named state dict with our own FP8/FP4 quantizers, per the
inventory: FP8 dense linears with `.scale`, FP4 routed experts, BF16 embed/head/norms/compressors/
`weights_proj`/gate, F32 HC/sink/ape/bias, I64 `tid2eid`. Non-quantized configs keep linears in the
dtype given (bf16 or fp32). Output: `config.json` (`config.to_hub_dict()`), `model.safetensors` or
shards `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, optional
`generation_config.json`, and tokenizer files copied from `tokenizer_dir`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import save_file

from moemesh.common.checkpoint.errors import CheckpointError
from moemesh.common.model.inventory import StorageKind, TensorSpec, tensor_inventory
from moemesh.common.checkpoint.quant import quantize_fp4, quantize_fp8_block
from moemesh.common.model.config import ModelConfig

log = structlog.get_logger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_TORCH_DTYPE = {StorageKind.BF16: torch.bfloat16, StorageKind.F32: torch.float32, StorageKind.I64: torch.int64}


def _encode(spec: TensorSpec, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float tensor of one logical spec -> its safetensors entries."""
    if tuple(tensor.shape) != spec.shape:
        raise CheckpointError(f"{spec.name}: expected shape {list(spec.shape)}, got {list(tensor.shape)}")
    tensor = tensor.detach().cpu()
    if spec.storage is StorageKind.FP8_BLOCK:
        weight, scale = quantize_fp8_block(tensor, spec.block_size)
        return {spec.name: weight, spec.scale_name: scale}
    if spec.storage is StorageKind.FP4_BLOCK:
        weight, scale = quantize_fp4(tensor, spec.block_size[1])
        return {spec.name: weight, spec.scale_name: scale}
    if spec.storage is StorageKind.FLOAT:
        if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            tensor = tensor.to(torch.bfloat16)
        return {spec.name: tensor.contiguous()}
    if spec.storage is StorageKind.I64 and tensor.is_floating_point():
        raise CheckpointError(f"{spec.name}: expected integer expert ids, got {tensor.dtype}")
    return {spec.name: tensor.to(_TORCH_DTYPE[spec.storage]).contiguous()}


def _shard_plan(entries: list[tuple[str, int]], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy split in inventory order; a tensor larger than the limit gets its own shard."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, num_bytes in entries:
        if max_shard_bytes is not None and shards[-1] and size + num_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += num_bytes
    return shards


def write_checkpoint(
    path: str | Path,
    config: ModelConfig,
    hub_state_dict: dict[str, torch.Tensor],
    *,
    max_shard_bytes: int | None = None,
    tokenizer_dir: str | Path | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Quantize and write `hub_state_dict` (float, hub names) as a hub-format checkpoint at `path`.

    Every inventory tensor except `mtp.*` must be present (mtp.* is written when given, all or
    none); a name outside the inventory raises `CheckpointError`.
    """
    path = Path(path)
    inventory = tensor_inventory(config)
    unknown = sorted(set(hub_state_dict) - set(inventory))
    if unknown:
        raise CheckpointError(f"{unknown[0]}: not a tensor of this config's inventory ({len(unknown)} unknown)")
    mtp_given = any(spec.is_mtp and name in hub_state_dict for name, spec in inventory.items())
    wanted = [spec for spec in inventory.values() if mtp_given or not spec.is_mtp]
    for spec in wanted:  # check everything before spending time on quantization
        if spec.name not in hub_state_dict:
            raise CheckpointError(f"{spec.name}: missing from the state dict (expected shape {list(spec.shape)})")
        if tuple(hub_state_dict[spec.name].shape) != spec.shape:
            found = list(hub_state_dict[spec.name].shape)
            raise CheckpointError(f"{spec.name}: expected shape {list(spec.shape)}, got {found}")
    encoded: dict[str, torch.Tensor] = {}
    for spec in wanted:
        encoded.update(_encode(spec, hub_state_dict[spec.name]))

    path.mkdir(parents=True, exist_ok=True)
    hub_config = config.to_hub_dict()
    # the real config.json carries it; without it transformers reads tensors to guess a dtype
    # and fails on F8_E8M0 scales
    hub_config.setdefault("torch_dtype", "bfloat16")
    with open(path / "config.json", "w", encoding="utf-8") as handle:
        json.dump(hub_config, handle, indent=2)
    sizes = [(name, tensor.numel() * tensor.element_size()) for name, tensor in encoded.items()]
    shards = _shard_plan(sizes, max_shard_bytes)
    if max_shard_bytes is None:
        save_file(encoded, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for index, names in enumerate(shards, start=1):
            file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file({name: encoded[name] for name in names}, str(path / file_name), metadata={"format": "pt"})
            weight_map.update({name: file_name for name in names})
        index_doc = {"metadata": {"total_size": sum(size for _, size in sizes)}, "weight_map": weight_map}
        with open(path / "model.safetensors.index.json", "w", encoding="utf-8") as handle:
            json.dump(index_doc, handle, indent=2)
    if generation_config is not None:
        with open(path / "generation_config.json", "w", encoding="utf-8") as handle:
            json.dump(generation_config, handle, indent=2)
    if tokenizer_dir is not None:
        for file_name in TOKENIZER_FILES:
            source = Path(tokenizer_dir) / file_name
            if source.exists():
                shutil.copyfile(source, path / file_name)
    log.info("checkpoint.written", path=str(path), num_entries=len(encoded), num_shards=len(shards))
    return path
