"""KV pool geometry and row storage (no torch: the CLI and the router read it)."""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.common.model.kv_sizing import DEFAULT_NUM_CPU_SNAPSHOTS, DEFAULT_NUM_PRIMARY_SNAPSHOTS
from moemesh.common.model.kv_storage import KVStorage


@dataclass(frozen=True)
class KVPoolConfig:
    """block_size_tokens: positions per block, a multiple of every compression ratio (128 for
    DeepSeek-V4); num_primary_blocks: blocks in the compute device's pool; num_cpu_blocks: blocks
    in the host tier (0: no swapping); kv_storage: how window and compressed rows are stored (the
    `kv_dtype` setting, common/model/kv_storage.py); num_primary_snapshots / num_cpu_snapshots: resume
    snapshots (what a sequence needs to resume at a block end besides its blocks) in each tier."""

    block_size_tokens: int = 128
    num_primary_blocks: int = 256
    num_cpu_blocks: int = 0
    kv_storage: KVStorage = KVStorage.BF16
    num_primary_snapshots: int = DEFAULT_NUM_PRIMARY_SNAPSHOTS
    num_cpu_snapshots: int = DEFAULT_NUM_CPU_SNAPSHOTS

    def __post_init__(self) -> None:
        for key, value, least in (("block_size_tokens", self.block_size_tokens, 1),
                                  ("num_primary_blocks", self.num_primary_blocks, 1),
                                  ("num_cpu_blocks", self.num_cpu_blocks, 0),
                                  ("num_primary_snapshots", self.num_primary_snapshots, 0),
                                  ("num_cpu_snapshots", self.num_cpu_snapshots, 0)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"bad KV pool geometry: {key}={value!r} (at least {least})")
        if not isinstance(self.kv_storage, KVStorage):
            raise ValueError(f"kv_storage: {self.kv_storage!r} is not a KVStorage")
