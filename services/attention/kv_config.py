"""KV pool geometry (no torch: the CLI and the router read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVPoolConfig:
    """block_size_tokens: positions per block, a multiple of every compression ratio (128 for
    DeepSeek-V4); num_primary_blocks: blocks in the compute device's pool; num_cpu_blocks: blocks
    in the host tier (0: no swapping)."""

    block_size_tokens: int = 128
    num_primary_blocks: int = 256
    num_cpu_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size_tokens < 1 or self.num_primary_blocks < 1 or self.num_cpu_blocks < 0:
            raise ValueError(f"bad KV pool geometry: {self}")
