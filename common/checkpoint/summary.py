"""What a checkpoint holds, as plain data (used by `moemesh check-model`).

Counts come from the inventory for the entries actually present; dtypes are the ones found on
disk. The optional forward builds the single-process reference model from the checkpoint and
runs one prompt; it dequantizes everything, so only use it on models that fit in memory.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

from moemesh.common.model.inventory import SAFETENSORS_DTYPE_BYTES, ParamGroup
from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.model.config import AttentionKind, RouterKind

_KIND_LABEL = {AttentionKind.WINDOW: "window", AttentionKind.CSA: "csa", AttentionKind.HCA: "hca"}
_ROUTER_LABEL = {RouterKind.HASH: "hash", RouterKind.LEARNED: "learned"}
MAX_LISTED_NAMES = 20


def summarize(reader: CheckpointReader) -> dict[str, Any]:
    """Layers, parameters/bytes/dtypes by group, and differences from the inventory."""
    config = reader.config
    params: Counter = Counter()
    num_bytes: Counter = Counter()
    dtypes: dict[str, set[str]] = defaultdict(set)
    for spec in reader.inventory.values():
        entries = [entry for entry in spec.stored_entries() if reader.found_dtype(entry.name) is not None]
        if not entries:
            continue
        group = spec.group.value
        params[group] += spec.num_params
        for entry in entries:
            dtype = reader.found_dtype(entry.name)
            dtypes[group].add(dtype)
            count = 1
            for size in entry.shape:
                count *= size
            num_bytes[group] += count * SAFETENSORS_DTYPE_BYTES.get(dtype, 0)
    layers = [
        {"layer": layer, "attention": _KIND_LABEL[config.layer_types[layer]],
         "compress_ratio": config.compress_ratio(layer), "router": _ROUTER_LABEL[config.mlp_layer_types[layer]]}
        for layer in range(config.num_hidden_layers)
    ]
    report = reader.report
    groups = [
        {"group": group.value, "num_params": params[group.value], "num_bytes": num_bytes[group.value],
         "dtypes": sorted(dtypes[group.value])}
        for group in ParamGroup if params[group.value]
    ]
    return {
        "path": str(reader.path),
        "hub_named": reader.hub_named,
        "num_layers": config.num_hidden_layers,
        "num_mtp_blocks": config.num_nextn_predict_layers,
        "dspark": config.dspark is not None,
        "fp8_block_size": None if config.fp8_block_size is None else list(config.fp8_block_size),
        "expert_dtype": config.expert_dtype,
        "layers": layers,
        "groups": groups,
        "total_params": sum(params.values()),
        "total_bytes": sum(num_bytes.values()),
        "num_missing": len(report.missing),
        "missing": report.missing[:MAX_LISTED_NAMES],
        "num_unexpected": len(report.unexpected),
        "unexpected": report.unexpected[:MAX_LISTED_NAMES],
        "num_mismatched": len(report.mismatched),
        "mismatched": report.mismatched[:MAX_LISTED_NAMES],
    }


def encode_prompt(path: Path, prompt: str, vocab_size: int) -> tuple[list[int], str]:
    """Token ids for `prompt` with the checkpoint's `tokenizer.json`, or UTF-8 bytes mod vocab
    (tiny test checkpoints ship no tokenizer). Returns (ids, how they were made)."""
    tokenizer_file = path / "tokenizer.json"
    if tokenizer_file.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tokenizer_file)).encode(prompt).ids, "tokenizer.json"
    return [byte % vocab_size for byte in prompt.encode("utf-8")], "utf-8 bytes (no tokenizer.json)"


def run_reference_forward(reader: CheckpointReader, token_ids: list[int], device: str = "cpu",
                          dtype: str = "float32", top_k: int = 5) -> dict[str, Any]:
    """One forward of the reference model over `token_ids`; next-token top-k of the last position."""
    from moemesh.common.checkpoint.reference_model import load_reference_model
    from moemesh.common.model.config import NumericsConfig

    model = load_reference_model(reader, NumericsConfig(dtype=dtype), device)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    logits = model.forward_sequence(ids).float()  # [S, V]
    last = logits[-1]
    top = torch.topk(last, min(top_k, last.shape[0]))
    return {
        "num_tokens": len(token_ids),
        "finite": bool(torch.isfinite(logits).all()),
        "logits_abs_max": float(logits.abs().max()),
        "top_token_ids": top.indices.tolist(),
        "top_logits": [round(v, 4) for v in top.values.tolist()],
    }
