"""What the attention worker's KV pool holds per block, per resume snapshot and per layer type, in bytes and in
tokens (torch-free: the start-up memory budget and the command line price the pool with it before torch is loaded).

The pool has two kinds of entries (docs/design.md §4), each a list of `BlockSegment`s, one tensor of the pool
([entries, rows, width] in one element type) that `services/attention/kv_pool.py` allocates exactly as listed here:
- a block covers `block_size_tokens` consecutive positions of one sequence and holds what grows with the context:
  "csa" / "hca" the compressed rows, B / m rows (main row format); "indexer" (CSA layers) the indexer's
  compressed rows, B / m rows (indexer row format);
- a resume snapshot holds what a sequence needs to resume at one block end, a fixed size whatever the context:
  "window" (every layer) the last W window rows (main row format); on CSA layers the compressor's and the
  indexer's pending inputs, m rows of 2·hd fp32 for K and for Z (HCA's ratio divides B: none pending).
Rows are stored as `KVStorage` says: FP8 main rows of `MainRowLayout.row_bytes` and FP8 indexer rows of
`IndexerRowLayout.row_bytes` bytes (uint8), or `activation_bytes` per channel (bf16: 2, fp32: 4).

So a context token costs only its rows; snapshots are a separate pool whose size (`num_primary_snapshots`,
`num_cpu_snapshots`) the deployment sets, a few per running sequence plus those kept for the prefix cache. Every
block holds every layer type's rows, so each layer type has the same token capacity: blocks × B on the device, and
as many again per block of the CPU tier.
Legend: B tokens per block, m compression ratio, W sliding window, hd head dim.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.kv_layouts import IndexerRowLayout, MainRowLayout
from moemesh.common.model.kv_storage import KVStorage

PENDING_INPUT_BYTES = 4  # the compressors' pending inputs are fp32 in every storage
# Resume snapshots per tier unless a deployment says otherwise: the router's bookkeeping and the attention worker's
# pool take the same defaults (a snapshot id the router hands out must exist in the pool).
DEFAULT_NUM_PRIMARY_SNAPSHOTS = 256
DEFAULT_NUM_CPU_SNAPSHOTS = 64
# Tokens a sequence's state can roll back (its window rings keep this many rows past the window): also the
# longest chunk per sequence the attention worker's decode graphs replay, which the router's scheduler sizes
# short prefills to.
DEFAULT_MAX_ROLLBACK_TOKENS = 8


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
    """One tensor of the pool, per entry: [num_rows, width] elements. `grows`: rows of the context (compressed and
    indexer rows, one entry per block); else part of a resume snapshot (one entry per snapshot)."""

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
    """One layer type's share of the pool: its layers, row bytes per block, bytes per resume snapshot and tokens
    held."""

    layer_type: LayerType
    num_layers: int
    row_bytes_per_block: int
    snapshot_bytes: int  # its part of one resume snapshot
    block_size_tokens: int
    primary_tokens: int
    cpu_tokens: int

    @property
    def row_bytes_per_token(self) -> float:
        """What one more context token stores in this layer type's rows (0 for window layers)."""
        return self.row_bytes_per_block / self.block_size_tokens


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
    """The pool of one attention worker: its block geometry, row storage, resume snapshots and every segment."""

    block_size_tokens: int
    num_primary_blocks: int
    num_cpu_blocks: int
    kv_storage: KVStorage
    activation_bytes: int
    segments: tuple[BlockSegment, ...]
    num_primary_snapshots: int = 0
    num_cpu_snapshots: int = 0

    @classmethod
    def of(cls, config: ModelConfig, *, block_size_tokens: int, num_primary_blocks: int, num_cpu_blocks: int,
           kv_storage: KVStorage, activation_bytes: int, num_primary_snapshots: int = 0,
           num_cpu_snapshots: int = 0) -> KVPoolSizing:
        """activation_bytes: bytes of one activation-dtype element (plain rows: bf16 2, fp32 4)."""
        if activation_bytes not in (2, 4):
            raise ValueError(f"activation_bytes={activation_bytes}: rows are kept in bf16 / fp16 (2) or fp32 (4)")
        return cls(block_size_tokens, num_primary_blocks, num_cpu_blocks, kv_storage, activation_bytes,
                   block_segments(config, block_size_tokens, kv_storage, activation_bytes), num_primary_snapshots,
                   num_cpu_snapshots)

    @property
    def row_segments(self) -> tuple[BlockSegment, ...]:
        """The tensors of a block (what grows with the context)."""
        return tuple(segment for segment in self.segments if segment.grows)

    @property
    def snapshot_segments(self) -> tuple[BlockSegment, ...]:
        """The tensors of a resume snapshot."""
        return tuple(segment for segment in self.segments if not segment.grows)

    @property
    def bytes_per_block(self) -> int:
        """One block's compressed and indexer rows, as stored (the same in both tiers): what a context token costs."""
        return sum(segment.num_bytes for segment in self.row_segments)

    @property
    def bytes_per_snapshot(self) -> int:
        """One resume snapshot (window rows of every layer, pending compressor inputs), as stored."""
        return sum(segment.num_bytes for segment in self.snapshot_segments)

    @property
    def primary_tokens(self) -> int:
        return self.num_primary_blocks * self.block_size_tokens

    @property
    def cpu_tokens(self) -> int:
        return self.num_cpu_blocks * self.block_size_tokens

    @property
    def primary_bytes(self) -> int:
        """The device tier: its blocks and its resume snapshots."""
        return self.num_primary_blocks * self.bytes_per_block + self.num_primary_snapshots * self.bytes_per_snapshot

    @property
    def cpu_bytes(self) -> int:
        return self.num_cpu_blocks * self.bytes_per_block + self.num_cpu_snapshots * self.bytes_per_snapshot

    def by_layer_type(self) -> dict[LayerType, LayerTypeCapacity]:
        """Each layer type present in the model -> its row bytes per block, snapshot bytes and tokens per tier."""
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
