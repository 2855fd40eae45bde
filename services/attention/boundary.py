"""Boundary snapshots: what a KV block holds so a sequence can resume at the block's end.

A block's compressed and indexer rows already live in the pool (`kv_pool.py`). The rest of a
sequence's state at position b = k·B (the end of its block k-1) is fixed-size and lives in
the slot: the raw window rows of positions b-W .. b-1 and every overlapping compressor's
pending inputs b-m .. b-1 (a non-overlapping compressor with m | B has none at b). The
recording stores below copy exactly those into the block's snapshot entries at the moment a
forward's append crosses b, whether b falls at the end of the appended rows or inside a long
prefill chunk; `restore_state` rebuilds a fresh `SequenceState` at b from them.

Why capture on append: after a chunk that runs past b the window ring no longer holds
b-W .. b-1, and nothing else can recompute those rows without the layer inputs.

Invariants:
- A snapshot at b depends only on tokens before b, so one written while drafts were in
  flight is right whenever those tokens are later confirmed, and is rewritten when the
  sequence crosses b again after a rollback.
- Never written at or below `Recorder.num_sealed_tokens` (the restore point): those blocks
  came from the prefix cache or the CPU tier, are full, and may be shared (immutable).
Legend: B tokens per block, W sliding window, m compression ratio, n new positions,
P positions of a combined buffer, C row or input dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model.config import AttentionKind, ModelConfig
from common.model.state import DEFAULT_MAX_ROLLBACK_TOKENS, CompressorStore, SequenceState, WindowStore
from services.attention.kv_pool import BlockTable, KVPool, KVPoolError


@dataclass
class Recorder:
    """Where one sequence's boundary snapshots go: its block table in the pool's primary tier."""

    pool: KVPool
    table: BlockTable
    num_sealed_tokens: int = 0  # boundaries at or below this are never written

    @property
    def block_size_tokens(self) -> int:
        return self.pool.config.block_size_tokens

    def boundaries(self, first_position: int, end_position: int) -> range:
        """Block ends b with first_position < b <= end_position, above the sealed prefix."""
        size = self.block_size_tokens
        low = max(first_position, self.num_sealed_tokens) // size + 1
        return range(low * size, end_position + 1, size)

    def block_of_boundary(self, boundary: int) -> int:
        index = boundary // self.block_size_tokens - 1
        if index >= len(self.table.block_ids):
            raise KVPoolError(f"boundary {boundary} needs block {index}, the table has {len(self.table.block_ids)}")
        return self.table.block_ids[index]

    def write(self, key: tuple[int, str], boundary: int, rows: torch.Tensor) -> None:
        """rows [n, C] right-aligned in the snapshot (its last row is position boundary-1)."""
        target = self.pool.primary[key][self.block_of_boundary(boundary)]  # [S, C]
        target[target.shape[0] - rows.shape[0]:] = rows.to(target.dtype)

    def read(self, key: tuple[int, str], block_id: int, num_rows: int) -> torch.Tensor:
        """The last num_rows rows of a block's snapshot -> [num_rows, C]."""
        snapshot = self.pool.primary[key][block_id]
        return snapshot[snapshot.shape[0] - num_rows:]


class RecordingWindowStore(WindowStore):
    """A WindowStore that snapshots positions b-W .. b-1 when an append crosses a block end b."""

    def __init__(self, recorder: Recorder, layer: int, sliding_window: int, row_dim: int, max_rollback_tokens: int,
                 dtype, device) -> None:
        super().__init__(sliding_window, row_dim, max_rollback_tokens, dtype, device)
        self.recorder = recorder
        self.layer = layer
        self.sliding_window = sliding_window

    def append(self, rows: torch.Tensor) -> None:
        start = self.num_tokens
        boundaries = self.recorder.boundaries(start, start + rows.shape[0])
        if boundaries:
            first = max(0, start - self.sliding_window)
            combined = torch.cat([self.read(first).to(rows.dtype), rows])  # [P, C] positions first ..
            for boundary in boundaries:
                low = max(0, boundary - self.sliding_window)
                self.recorder.write((self.layer, "window_snapshot"), boundary, combined[low - first: boundary - first])
        super().append(rows)

    def load_boundary(self, num_tokens: int, rows: torch.Tensor) -> None:
        """Stand at num_tokens with rows [n, C] as positions num_tokens-n .. num_tokens-1 (fresh store)."""
        if self.num_tokens:
            raise RuntimeError("load_boundary needs a fresh store")
        self._counter.advance(num_tokens - rows.shape[0])
        super().append(rows)


class RecordingCompressorStore(CompressorStore):
    """A CompressorStore that snapshots the pending inputs the next window close needs at a block end."""

    def __init__(self, recorder: Recorder, layer: int, which: str, ratio: int, input_dim: int, row_dim: int,
                 overlap: bool, max_rollback_tokens: int, dtype, device, row_store) -> None:
        super().__init__(ratio, input_dim, row_dim, overlap, max_rollback_tokens, dtype, device, row_store=row_store)
        self.recorder = recorder
        self.layer = layer
        self.which = which

    def num_pending_at_boundary(self) -> int:
        """Inputs still needed at a block end (a multiple of the ratio): the previous window with overlap."""
        return self.ratio if self.overlap else 0

    def append_inputs(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        start = self.num_tokens
        num_pending = self.num_pending_at_boundary()
        boundaries = self.recorder.boundaries(start, start + kv.shape[0]) if num_pending else range(0)
        if boundaries:
            first = self.first_needed_position()
            old_kv, old_score = self.read_inputs(first)
            all_kv, all_score = torch.cat([old_kv, kv.float()]), torch.cat([old_score, score.float()])  # [P, C]
            for boundary in boundaries:
                low = boundary - num_pending
                self.recorder.write((self.layer, f"{self.which}_pending_kv"), boundary,
                                    all_kv[low - first: boundary - first])
                self.recorder.write((self.layer, f"{self.which}_pending_score"), boundary,
                                    all_score[low - first: boundary - first])
        super().append_inputs(kv, score)

    def load_boundary(self, num_tokens: int, kv: torch.Tensor | None, score: torch.Tensor | None) -> None:
        """Stand at num_tokens with pending inputs [n, C] of positions num_tokens-n .. (None: no
        pending inputs). Only for a fresh store."""
        if self.num_tokens:
            raise RuntimeError("load_boundary needs a fresh store")
        num_pending = 0 if kv is None else kv.shape[0]
        self._counter.advance(num_tokens - num_pending)
        if num_pending:
            super().append_inputs(kv, score)


def recording_state(config: ModelConfig, pool: KVPool, table: BlockTable, recorder: Recorder,
                    dtype: torch.dtype, device: torch.device,
                    max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS) -> SequenceState:
    """A SequenceState whose rows live in the pool (through table) and which records snapshots.

    The stores are built with the same geometry SequenceState gives its own (same ring sizes,
    input widths and overlap), then replace them."""
    state = SequenceState(config, max_rollback_tokens=max_rollback_tokens, dtype=dtype, device=device,
                          row_store_factory=pool.row_store_factory(table))
    rows_of = pool.row_store_factory(table)
    for layer, layer_state in enumerate(state.layers):
        layer_state.window = RecordingWindowStore(recorder, layer, config.sliding_window, config.head_dim,
                                                  max_rollback_tokens, dtype, device)
        ratio = config.compress_ratio(layer)
        if layer_state.kind is AttentionKind.CSA:
            layer_state.compressor = RecordingCompressorStore(
                recorder, layer, "compressor", ratio, 2 * config.head_dim, config.head_dim, True, max_rollback_tokens,
                dtype, device, rows_of(layer, "compressor", config.head_dim))
            layer_state.indexer = RecordingCompressorStore(
                recorder, layer, "indexer", ratio, 2 * config.index_head_dim, config.index_head_dim, True,
                max_rollback_tokens, dtype, device, rows_of(layer, "indexer", config.index_head_dim))
        elif layer_state.kind is AttentionKind.HCA:
            layer_state.compressor = RecordingCompressorStore(
                recorder, layer, "compressor", ratio, config.head_dim, config.head_dim, False, max_rollback_tokens,
                dtype, device, rows_of(layer, "compressor", config.head_dim))
    return state


def restore_state(state: SequenceState, recorder: Recorder, num_tokens: int) -> None:
    """Position a fresh recording state at the block boundary num_tokens from its last block's snapshot.

    The table (recorder.table) must already hold the blocks of positions 0 .. num_tokens-1;
    their compressed rows are read through it, so only the fixed-size part is loaded here."""
    if state.num_tokens:
        raise RuntimeError("restore_state needs a fresh state")
    size = recorder.block_size_tokens
    if num_tokens <= 0 or num_tokens % size:
        raise KVPoolError(f"restore at {num_tokens} tokens is not a block boundary (block size {size})")
    num_blocks = recorder.pool.config.num_primary_blocks
    if any(not 0 <= block_id < num_blocks for block_id in recorder.table.block_ids):
        raise KVPoolError(f"restore from blocks {recorder.table.block_ids}: outside the primary tier "
                          f"({num_blocks} blocks)")
    last_block = recorder.block_of_boundary(num_tokens)
    for layer, layer_state in enumerate(state.layers):
        window = layer_state.window
        num_window_rows = min(num_tokens, window.sliding_window)
        window.load_boundary(num_tokens, recorder.read((layer, "window_snapshot"), last_block, num_window_rows))
        for store in (layer_state.compressor, layer_state.indexer):
            if store is None:
                continue
            num_pending = store.num_pending_at_boundary()
            if num_pending == 0:
                store.load_boundary(num_tokens, None, None)
                continue
            store.load_boundary(num_tokens, recorder.read((layer, f"{store.which}_pending_kv"), last_block, num_pending),
                                recorder.read((layer, f"{store.which}_pending_score"), last_block, num_pending))
    state.num_tokens = num_tokens
    recorder.num_sealed_tokens = num_tokens
