"""The attention worker's start-up line about its KV pool: how many context tokens it holds where.

One `attention.kv_capacity` event, its `message` "KV capacity: N tokens on <device>, M on the CPU tier", with the
figures of `common.model.kv_sizing` (what the pool allocated): tokens and bytes per tier, bytes per block and per
context token, resume snapshots per tier and their bytes, and per layer type (window, CSA, HCA, indexer) its
layers, row bytes per token and per block, and its part of a snapshot.
"""

from __future__ import annotations

import structlog

from moemesh.common.model.kv_sizing import KVPoolSizing

log = structlog.get_logger("attention")


def kv_capacity_fields(sizing: KVPoolSizing, device: str) -> dict:
    """The event's fields (JSON-ready)."""
    by_type = {
        capacity.layer_type.value: {"num_layers": capacity.num_layers,
                                    "row_bytes_per_token": round(capacity.row_bytes_per_token, 2),
                                    "row_bytes_per_block": capacity.row_bytes_per_block,
                                    "snapshot_bytes": capacity.snapshot_bytes,
                                    "tokens": capacity.primary_tokens, "cpu_tier_tokens": capacity.cpu_tokens}
        for capacity in sizing.by_layer_type().values()}
    return {"message": sizing.capacity_line(device), "device": device, "kv_dtype": sizing.kv_storage.value,
            "tokens": sizing.primary_tokens, "cpu_tier_tokens": sizing.cpu_tokens,
            "device_bytes": sizing.primary_bytes, "cpu_tier_bytes": sizing.cpu_bytes,
            "bytes_per_block": sizing.bytes_per_block,
            "bytes_per_token": round(sizing.bytes_per_block / sizing.block_size_tokens, 2),
            "bytes_per_snapshot": sizing.bytes_per_snapshot,
            "snapshots": sizing.num_primary_snapshots, "cpu_tier_snapshots": sizing.num_cpu_snapshots,
            "by_layer_type": by_type}


def log_kv_capacity(name: str, sizing: KVPoolSizing, device: str) -> dict:
    """Log the event (see the module docstring); returns its fields."""
    fields = kv_capacity_fields(sizing, device)
    log.info("attention.kv_capacity", name=name, **fields)
    return fields
