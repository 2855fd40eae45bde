"""Device address tables that let one kernel launch reach every sequence's KV stores.

A sequence's decode state (common/model/state.py) keeps separate tensors per sequence and layer:
the window ring, the compressor input rings and the compressed rows (its own growing tensor, a
preallocated tensor, or blocks of the attention worker's paged pool). Rather than gather them
into one tensor per step (extra copies, one launch per sequence), the batched kernels load each
sequence's *addresses* from a small int64 table and read or write the stores in place.

Tables of one forward (`AttentionTables`, built once in `ForwardBatch.__init__`, outside any
CUDA-graph capture, with one host-to-device copy):
- `fields` [L, B, F] int64: per layer and sequence the addresses and sizes named by `Field`
  (absent stores: 0). Window and input rings never move; own row tensors only move when they
  grow, which `SequenceState.reserve_tokens` does before the tables are built.
- `seq_info` [B, 3] int64: chunk start position, flat index of the chunk's first token, length.
- `token_seq` [T] int32: which sequence each flat token belongs to; `positions` [T] int64.
- `block_ids` [B, NB] int64: the paged pool's block table per sequence (zeros [B, 1] when every
  row store is contiguous). Row r of a store lives at
  `rows_addr + (block_ids[b, r // P] · P + r mod P) · row_bytes`, with P = `rows_per_block`
  (2^40 for contiguous stores, so the block index is always 0).
- `closing_tokens(m)` [Nc] int64: flat indices of the tokens that close a ratio-m window
  (position p with (p + 1) mod m == 0), i.e. the compressed rows this forward emits.

Every per-token quantity (window start, visible rows) is recomputed in the kernels from the
position, so one table serves decode, speculative verification (several tokens per sequence)
and chunked prefill alike.

Row formats: window rings and compressed rows are in `state_dtype` (the activation dtype) unless `main_rows`
gives the FP8 main-row layout (`common.model.kv_layouts.MainRowLayout`: e4m3 non-rotary channels, bf16 rotary
channels, one ue8m0 byte per block of 64); indexer rows likewise unless `indexer_rows` gives the FP8 indexer-row
layout (`IndexerRowLayout`: e4m3 channels, one fp32 scale). The kernels then quantize on write and dequantize in
registers on read, with `row_bytes` between rows.
Legend: L layers, B sequences, T tokens, F fields, NB blocks per sequence, Nc closing tokens.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

CONTIGUOUS_ROWS_PER_BLOCK = 1 << 40


class Field(enum.IntEnum):
    WINDOW_ADDR = 0
    WINDOW_RING = 1
    ROWS_ADDR = 2
    INDEX_ROWS_ADDR = 3
    INPUT_KV_ADDR = 4
    INPUT_SCORE_ADDR = 5
    INPUT_RING = 6
    INDEX_INPUT_KV_ADDR = 7
    INDEX_INPUT_SCORE_ADDR = 8
    INDEX_INPUT_RING = 9


NUM_FIELDS = len(Field)


class MainRowBytes(Protocol):
    """What the kernels read of an FP8 main-row layout (`common.model.kv_rows.MainRowLayout`)."""

    @property
    def nope_dim(self) -> int: ...

    @property
    def rope_dim(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def rope_offset(self) -> int: ...

    @property
    def scale_offset(self) -> int: ...

    @property
    def row_bytes(self) -> int: ...


class IndexerRowBytes(Protocol):
    """What the kernels read of an FP8 indexer-row layout (`common.model.kv_layouts.IndexerRowLayout`)."""

    @property
    def dim(self) -> int: ...

    @property
    def scale_offset(self) -> int: ...

    @property
    def row_bytes(self) -> int: ...


def check_indexer_row_layout(layout: IndexerRowBytes, head_dim: int) -> None:
    """The FP8 indexer rows the kernels handle: head_dim codes, then the fp32 scale, 4-byte aligned."""
    if layout.dim != head_dim or layout.scale_offset != head_dim or layout.row_bytes != head_dim + 4:
        raise ValueError(f"FP8 indexer rows {layout} for head_dim {head_dim}: the kernels read {head_dim} codes, "
                         f"then one fp32 scale")
    if head_dim % 4 or head_dim & (head_dim - 1):
        raise ValueError(f"FP8 indexer rows of {head_dim} channels: the kernels need a power of two of at least 4 "
                         f"(one tile per row, the fp32 scale 4-byte aligned)")


def check_main_row_layout(layout: MainRowBytes, head_dim: int) -> None:
    """The FP8 rows the kernels handle: nope + rope = head_dim, the scale bytes one aligned 8-byte word."""
    if layout.nope_dim + layout.rope_dim != head_dim:
        raise ValueError(f"FP8 rows of {layout.nope_dim} + {layout.rope_dim} channels for head_dim {head_dim}")
    if layout.num_blocks > 8 or layout.scale_offset % 8 or layout.row_bytes % 8 or layout.nope_dim % 2:
        raise ValueError(f"FP8 row layout {layout}: the kernels need at most 8 scale blocks, an even nope width and "
                         f"8-byte aligned scale bytes and rows")


class AttentionTables:
    """The device tables of one forward (see the module docstring). Built from sequence states by
    `common.model.attention_tables.build_tables`."""

    def __init__(self, fields: torch.Tensor, seq_info: torch.Tensor, token_seq: torch.Tensor,
                 positions: torch.Tensor, block_ids: torch.Tensor, rows_per_block: dict[tuple[int, str], int],
                 closing: dict[int, tuple[torch.Tensor, int]], max_rows_visible: dict[int, int],
                 max_position: int, state_dtype: torch.dtype, main_rows: MainRowBytes | None = None,
                 indexer_rows: IndexerRowBytes | None = None) -> None:
        self.state_dtype = state_dtype  # the activation dtype: the rows unless main_rows / indexer_rows
        self.main_rows = main_rows  # FP8 layout of the window rings and compressed rows (None: in state_dtype)
        self.indexer_rows = indexer_rows  # FP8 layout of the CSA indexer rows (None: in state_dtype)
        self.fields = fields  # [L, B, F]
        self.seq_info = seq_info  # [B, 3]
        self.token_seq = token_seq  # [T] int32
        self.positions = positions  # [T] int64
        self.block_ids = block_ids  # [B, NB]
        self._rows_per_block = rows_per_block
        self._closing = closing
        self._max_rows_visible = max_rows_visible
        self.max_position = max_position

    # With True, `closing_tokens` lists every token and the kernels test (pos + 1) mod m == 0 on the device
    # (static decode tables: services/attention/graph_tables.py); False: exactly the closing tokens.
    closing_predicated = False
    # static decode tables: the fewest real tokens a step over them has (sizes sparse attention's split grid)
    min_real_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_seq.shape[0]

    def device_split_size(self, window: int, ratio: int, topk: int | None) -> torch.Tensor | None:
        """A one-element int64 device tensor holding sparse attention's keys per split for layers of this
        (window, ratio, topk), filled by the host before each replay of a captured step; None: the
        launch plans its splits from this forward's host figures (`max_rows_visible`, `max_position`)."""
        return None

    def layer_fields(self, layer: int) -> torch.Tensor:
        """[B, F] int64 of one layer (a contiguous view)."""
        return self.fields[layer]

    def rows_per_block(self, layer: int, which: str) -> int:
        return self._rows_per_block[(layer, which)]

    def closing_tokens(self, ratio: int) -> tuple[torch.Tensor, int]:
        """(flat token indices [Nc] int64 that close a ratio-`ratio` window, Nc)."""
        return self._closing[ratio]

    def max_rows_visible(self, ratio: int) -> int:
        """Largest number of closed ratio-m windows any token of the forward sees."""
        return self._max_rows_visible[ratio]
