"""Byte layouts of the FP8 KV rows (torch-free: the pool sizing and the start-up memory budget read them without
loading torch; common/model/kv_rows.py packs and unpacks rows in these layouts and documents them).

- `MainRowLayout` (window and compressed rows): nope channels as e4m3 codes, rope channels as bf16, one ue8m0 byte
  per block of 64 nope channels, padded to a multiple of 8 bytes (V4-Flash: 448 + 128 + 7 + 1 = 584 bytes).
- `IndexerRowLayout` (CSA indexer rows): the channels as e4m3 codes, then one fp32 scale (V4-Flash: 132 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.common.model.config import ModelConfig

KV_FP8_BLOCK_SIZE = 64  # nope channels per ue8m0 scale of a main row (common/model/qat.py rounds in these blocks)
ROW_ALIGN_BYTES = 8


def _align(num_bytes: int) -> int:
    return -(-num_bytes // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES


@dataclass(frozen=True)
class MainRowLayout:
    """Byte layout of one FP8 main row."""

    nope_dim: int
    rope_dim: int
    block_size: int = KV_FP8_BLOCK_SIZE

    @property
    def dim(self) -> int:
        """Channels of one row."""
        return self.nope_dim + self.rope_dim

    @property
    def num_blocks(self) -> int:
        return -(-self.nope_dim // self.block_size)

    @property
    def rope_offset(self) -> int:
        return self.nope_dim

    @property
    def scale_offset(self) -> int:
        return self.nope_dim + 2 * self.rope_dim

    @property
    def row_bytes(self) -> int:
        return _align(self.scale_offset + self.num_blocks)

    @classmethod
    def of(cls, config: ModelConfig) -> MainRowLayout:
        return cls(config.nope_head_dim, config.qk_rope_head_dim)


@dataclass(frozen=True)
class IndexerRowLayout:
    """Byte layout of one FP8 indexer row."""

    dim: int

    @property
    def scale_offset(self) -> int:
        return self.dim

    @property
    def row_bytes(self) -> int:
        return self.dim + 4  # codes, then the fp32 scale (V4-Flash: 132; not padded, as the production pool)

    @classmethod
    def of(cls, config: ModelConfig) -> IndexerRowLayout:
        return cls(config.index_head_dim)
