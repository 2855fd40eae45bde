"""What the attention worker's KV pool holds per block and per layer type, in bytes and in tokens (torch-free:
the start-up memory budget and the command line price the pool with it before torch is loaded).

A pool block covers `block_size_tokens` consecutive positions of one sequence for every layer (docs/design.md §4).
It holds, per layer, a list of `BlockSegment`s, each one tensor of the pool ([blocks, rows, width] in one element
type) that `services/attention/kv_pool.py` allocates exactly as listed here:
- layer type "window" (every layer): the boundary snapshot of the window rows, W rows (main row format);
- "csa" / "hca": the compressed rows, B / m rows (main row format); on CSA layers also the boundary snapshot of
  the compressor's pending inputs, m rows of 2·hd fp32 for K and for Z (HCA's ratio divides B: none pending);
- "indexer" (CSA layers): the indexer's compressed rows, B / m rows (indexer row format), and its pending inputs.
Rows are stored as `KVStorage` says: FP8 main rows of `MainRowLayout.row_bytes` and FP8 indexer rows of
`IndexerRowLayout.row_bytes` bytes (uint8), or `activation_bytes` per channel (bf16: 2, fp32: 4).

The compressed and indexer rows grow with the context ("rows"); the snapshots are a fixed cost per block (they let
a sequence resume at the block's end: prefix reuse, swap-in). Every block holds every layer type's segments, so
each layer type has the same token capacity: blocks × B on the device, and as many again per block of the CPU tier.
Legend: B tokens per block, m compression ratio, W sliding window, hd head dim.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.kv_layouts import IndexerRowLayout, MainRowLayout
from moemesh.common.model.kv_storage import KVStorage

PENDING_INPUT_BYTES = 4  # the compressors' pending inputs are fp32 in every storage


class LayerType(enum.Enum):
    WINDOW = "window"
    CSA = "csa"
    HCA = "hca"
    INDEXER = "indexer"


class Element(enum.Enum):
    """What one stored element is: a byte of an FP8 row, an activation-dtype channel, or an fp32 input."""

    FP8_BYTE = "uint8"
    ACTIVATION = "activation"
    FLOAT32 = "float32"


@dataclass(frozen=True)
class BlockSegment:
    """One tensor of the pool, per block: [num_rows, width] elements. `grows`: rows of the context (compressed and
    indexer rows); else a boundary snapshot."""

    key: tuple[int, str]  # (layer, "compressor" | "indexer" | "window_snapshot" | "<which>_pending_kv|score")
    layer_type: LayerType
    num_rows: int
    width: int
    element: Element
    element_bytes: int
    grows: bool

    @property
    def num_bytes(self) -> int:
        """Bytes of this segment in one block."""
        return self.num_rows * self.width * self.element_bytes


@dataclass(frozen=True)
class LayerTypeCapacity:
    """One layer type's share of the pool: its layers, bytes per block (rows and snapshots) and tokens held."""

    layer_type: LayerType
    num_layers: int
    row_bytes_per_block: int
    snapshot_bytes_per_block: int
    block_size_tokens: int
    primary_tokens: int
    cpu_tokens: int

    @property
    def bytes_per_block(self) -> int:
        return self.row_bytes_per_block + self.snapshot_bytes_per_block

    @property
    def row_bytes_per_token(self) -> float:
        """What one more context token stores in this layer type's rows (0 for window layers)."""
        return self.row_bytes_per_block / self.block_size_tokens

    @property
    def primary_bytes(self) -> int:
        return self.bytes_per_block * (self.primary_tokens // self.block_size_tokens)

    @property
    def cpu_bytes(self) -> int:
        return self.bytes_per_block * (self.cpu_tokens // self.block_size_tokens)


def _main_row(config: ModelConfig, storage: KVStorage, activation_bytes: int) -> tuple[int, Element, int]:
    """(width, element, element bytes) of one stored main row."""
    if storage is KVStorage.FP8:
        return MainRowLayout.of(config).row_bytes, Element.FP8_BYTE, 1
    return config.head_dim, Element.ACTIVATION, activation_bytes


def _indexer_row(config: ModelConfig, storage: KVStorage, activation_bytes: int) -> tuple[int, Element, int]:
    if storage is KVStorage.FP8:
        return IndexerRowLayout.of(config).row_bytes, Element.FP8_BYTE, 1
    return config.index_head_dim, Element.ACTIVATION, activation_bytes


def block_segments(config: ModelConfig, block_size_tokens: int, storage: KVStorage,
                   activation_bytes: int) -> tuple[BlockSegment, ...]:
    """Every tensor of one pool block (module docstring); ValueError naming `block_size_tokens` when a layer's
    compression ratio does not divide it."""
    main = _main_row(config, storage, activation_bytes)
    indexer = _indexer_row(config, storage, activation_bytes)
    segments: list[BlockSegment] = []
    for layer, kind in enumerate(config.layer_types):
        ratio = config.compress_ratio(layer)
        if kind is not AttentionKind.WINDOW and block_size_tokens % ratio:
            raise ValueError(f"block_size_tokens={block_size_tokens} is not a multiple of layer {layer}'s "
                             f"compression ratio {ratio}")
        segments.append(BlockSegment((layer, "window_snapshot"), LayerType.WINDOW, config.sliding_window, *main,
                                     grows=False))
        if kind is AttentionKind.HCA:
            segments.append(BlockSegment((layer, "compressor"), LayerType.HCA, block_size_tokens // ratio, *main,
                                         grows=True))
        if kind is not AttentionKind.CSA:
            continue
        for which, layer_type, row, row_dim in (("compressor", LayerType.CSA, main, config.head_dim),
                                                ("indexer", LayerType.INDEXER, indexer, config.index_head_dim)):
            segments.append(BlockSegment((layer, which), layer_type, block_size_tokens // ratio, *row, grows=True))
            for name in ("pending_kv", "pending_score"):  # the previous window's inputs (overlap), K and Z
                segments.append(BlockSegment((layer, f"{which}_{name}"), layer_type, ratio, 2 * row_dim,
                                             Element.FLOAT32, PENDING_INPUT_BYTES, grows=False))
    return tuple(segments)


@dataclass(frozen=True)
class KVPoolSizing:
    """The pool of one attention worker: its block geometry, row storage and every segment of a block."""

    block_size_tokens: int
    num_primary_blocks: int
    num_cpu_blocks: int
    kv_storage: KVStorage
    activation_bytes: int
    segments: tuple[BlockSegment, ...]

    @classmethod
    def of(cls, config: ModelConfig, *, block_size_tokens: int, num_primary_blocks: int, num_cpu_blocks: int,
           kv_storage: KVStorage, activation_bytes: int) -> KVPoolSizing:
        """activation_bytes: bytes of one activation-dtype element (plain rows: bf16 2, fp32 4)."""
        if activation_bytes not in (2, 4):
            raise ValueError(f"activation_bytes={activation_bytes}: rows are kept in bf16 / fp16 (2) or fp32 (4)")
        return cls(block_size_tokens, num_primary_blocks, num_cpu_blocks, kv_storage, activation_bytes,
                   block_segments(config, block_size_tokens, kv_storage, activation_bytes))

    @property
    def bytes_per_block(self) -> int:
        """One block's rows and boundary snapshots, as stored (the same in both tiers)."""
        return sum(segment.num_bytes for segment in self.segments)

    @property
    def row_bytes_per_block(self) -> int:
        """One block's compressed and indexer rows alone (what grows with the context)."""
        return sum(segment.num_bytes for segment in self.segments if segment.grows)

    @property
    def primary_tokens(self) -> int:
        return self.num_primary_blocks * self.block_size_tokens

    @property
    def cpu_tokens(self) -> int:
        return self.num_cpu_blocks * self.block_size_tokens

    @property
    def primary_bytes(self) -> int:
        return self.num_primary_blocks * self.bytes_per_block

    @property
    def cpu_bytes(self) -> int:
        return self.num_cpu_blocks * self.bytes_per_block

    def by_layer_type(self) -> dict[LayerType, LayerTypeCapacity]:
        """Each layer type present in the model -> its bytes per block and tokens held in each tier."""
        out: dict[LayerType, LayerTypeCapacity] = {}
        for layer_type in LayerType:
            segments = [segment for segment in self.segments if segment.layer_type is layer_type]
            if not segments:
                continue
            out[layer_type] = LayerTypeCapacity(
                layer_type, len({segment.key[0] for segment in segments}),
                sum(segment.num_bytes for segment in segments if segment.grows),
                sum(segment.num_bytes for segment in segments if not segment.grows),
                self.block_size_tokens, self.primary_tokens, self.cpu_tokens)
        return out

    def capacity_line(self, device: str) -> str:
        """"KV capacity: N tokens on <device>, M on the CPU tier"."""
        return f"KV capacity: {self.primary_tokens:,} tokens on {device}, {self.cpu_tokens:,} on the CPU tier"
