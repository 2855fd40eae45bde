"""Resume snapshots: what a sequence needs, besides its KV blocks, to resume at a block end.

A block's compressed and indexer rows already live in the pool (`kv_pool.py`). The rest of a
sequence's state at position b = k·B (the end of its block k-1) is fixed-size and lives in
the slot: the raw window rows of positions b-W .. b-1 and every overlapping compressor's
pending inputs b-m .. b-1 (a non-overlapping compressor with m | B has none at b). The
recording stores below copy exactly those into a snapshot of the pool's snapshot tier at the
moment a forward's append crosses b, whether b falls at the end of the appended rows or inside
a long prefill chunk; `restore_state` rebuilds a fresh `SequenceState` at b from them.

Which block ends get a snapshot is the router's choice, per step (`Recorder.set_targets`:
(block index, snapshot id) pairs from the plan): the last block end a step crosses, so the
sequence can be swapped out and resumed, and those the prefix cache keeps. A block end without
a target is not recorded at all.

Why capture on append: after a chunk that runs past b the window ring no longer holds
b-W .. b-1, and nothing else can recompute those rows without the layer inputs.

The Triton kernel path (common/model/attention_kernels.py, and CUDA-graph replays through
`SequenceState.commit_kernel_writes`) never calls `append`: it writes the rings in place and then
calls `mark_written(n)`. The recording stores override `mark_written` to copy each crossed block
end's snapshot FROM THE RINGS, on the device (no host sync, so safe right after a graph replay).
Reach: after a kernel write ending at e, a ring of S rows still holds positions >= max(e, high
water) - S. The window snapshot at b needs b-W, so it is in the ring iff e - b <= S - W; the
pending inputs of an overlapping compressor need b-m, in the ring iff e - b <= S_c - m. With the
default rings (S = W + R, S_c >= R + 2m - 1 rounded up to m) a block end up to R tokens before the
write's end is always captured: every decode step and every verification of <= R drafts. A block
end deeper inside a long prefill chunk is captured only when the rings are sized for the chunk
(`recording_state(max_chunk_tokens=...)`: S = W + max(R, chunk)); otherwise its snapshot is
poisoned with NaN (and a `attention.boundary_snapshot_lost` warning is logged) so that
`restore_state` refuses it with a KVPoolError instead of resuming from garbage.

Window snapshots hold rows as the window ring stores them (bf16 or packed FP8 rows, `RowFormat`): rows
are copied as stored bytes, never decoded and re-encoded, so a restored ring is the source ring byte for
byte. A poisoned FP8 snapshot is filled with bytes that decode to NaN.

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

from dataclasses import dataclass, field

import structlog
import torch

from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.kv_rows import RowFormat
from moemesh.common.model.state import (
    DEFAULT_MAX_ROLLBACK_TOKENS, CompressorStore, SequenceState, WindowStore, _read_ring, _write_ring,
)
from moemesh.services.attention.kv_pool import BlockTable, KVPool, KVPoolError

log = structlog.get_logger("attention")


@dataclass
class Recorder:
    """Where one sequence's resume snapshots go: the snapshots its current plan names, per block end."""

    pool: KVPool
    table: BlockTable
    num_sealed_tokens: int = 0  # boundaries at or below this are never written
    targets: dict[int, int] = field(default_factory=dict)  # block index k (its end: (k+1)·B) -> snapshot id

    @property
    def block_size_tokens(self) -> int:
        return self.pool.config.block_size_tokens

    def set_targets(self, pairs) -> None:
        """This step's (block index, snapshot id) pairs, replacing the last step's; KVPoolError for an id outside
        the primary snapshot tier."""
        num_snapshots = self.pool.config.num_primary_snapshots
        targets = {int(index): int(snapshot) for index, snapshot in pairs}
        bad = [snapshot for snapshot in targets.values() if not 0 <= snapshot < num_snapshots]
        if bad:
            raise KVPoolError(f"resume snapshots {bad} are outside the primary tier ({num_snapshots} snapshots)")
        self.targets = targets

    def boundaries(self, first_position: int, end_position: int) -> list[int]:
        """Block ends b with first_position < b <= end_position, above the sealed prefix, that have a target."""
        if not self.targets:  # most steps: called per layer and store, so no range to build
            return []
        size = self.block_size_tokens
        low = max(first_position, self.num_sealed_tokens) // size + 1
        return [boundary for boundary in range(low * size, end_position + 1, size)
                if boundary // size - 1 in self.targets]

    def _snapshot(self, key: tuple[int, str], boundary: int) -> torch.Tensor:
        return self.pool.snapshot_primary[key][self.targets[boundary // self.block_size_tokens - 1]]  # [S, C]

    def write(self, key: tuple[int, str], boundary: int, rows: torch.Tensor) -> None:
        """rows [n, C] as stored, right-aligned in the boundary's snapshot (its last row is position boundary-1)."""
        target = self._snapshot(key, boundary)
        target[target.shape[0] - rows.shape[0]:] = rows.to(target.dtype)

    def poison(self, key: tuple[int, str], boundary: int) -> None:
        """Mark a snapshot that could not be captured (NaN once decoded), so a restore from it is refused."""
        snapshot = self._snapshot(key, boundary)
        if key[1] == "window_snapshot":
            self.pool.main_row_format.poison_(snapshot)
        else:
            snapshot.fill_(float("nan"))

    def read(self, key: tuple[int, str], snapshot_id: int, num_rows: int) -> torch.Tensor:
        """The last num_rows rows of a snapshot, as stored -> [num_rows, C]."""
        snapshot = self.pool.snapshot_primary[key][snapshot_id]
        return snapshot[snapshot.shape[0] - num_rows:]


class RecordingWindowStore(WindowStore):
    """A WindowStore that snapshots positions b-W .. b-1 when an append crosses a block end b."""

    def __init__(self, recorder: Recorder, layer: int, sliding_window: int, row_dim: int, max_rollback_tokens: int,
                 dtype, device, row_format: RowFormat | None = None) -> None:
        super().__init__(sliding_window, row_dim, max_rollback_tokens, dtype, device, row_format=row_format)
        self.recorder = recorder
        self.layer = layer
        self.sliding_window = sliding_window
        self._recorded_write: tuple[int, int] | None = None  # (start, tokens) snapshotted by record_write

    def append(self, rows: torch.Tensor) -> None:
        self.record_write(rows)
        self._recorded_write = None
        super().append(rows)

    def record_write(self, rows: torch.Tensor) -> None:
        """Snapshot every block end that writing rows [n, C] (positions num_tokens ..) crosses, from
        the ring and the rows themselves; called before a kernel overwrites the ring, so block ends
        deep inside a long prefill chunk are captured too (mark_written then skips this write)."""
        start = self.num_tokens
        boundaries = self.recorder.boundaries(start, start + rows.shape[0])
        if boundaries:
            first = max(0, start - self.sliding_window)
            self._counter.check_readable(first, self.ring_size, "window")
            # [P, Ws] positions first .., as stored (the kernels encode the new rows exactly as `encode` does)
            combined = torch.cat([_read_ring(self._rows, first, start), self.row_format.encode(rows)])
            for boundary in boundaries:
                low = max(0, boundary - self.sliding_window)
                self.recorder.write((self.layer, "window_snapshot"), boundary, combined[low - first: boundary - first])
        self._recorded_write = (start, rows.shape[0])

    def mark_written(self, num_tokens: int) -> None:
        """A kernel wrote positions start .. start+n-1 into the ring: snapshot each crossed block end
        b from the ring (rows b-W .. b-1), or poison it when the write already overwrote b-W."""
        start = self.num_tokens
        recorded, self._recorded_write = self._recorded_write == (start, num_tokens), None
        super().mark_written(num_tokens)
        if recorded:  # record_write saw these rows before the kernel wrote them
            return
        oldest_retained = self._counter.high_water - self.ring_size
        for boundary in self.recorder.boundaries(start, start + num_tokens):
            low = max(0, boundary - self.sliding_window)
            key = (self.layer, "window_snapshot")
            if low < oldest_retained:
                _log_lost(self.layer, "window", boundary, start, num_tokens, self.ring_size)
                self.recorder.poison(key, boundary)
                continue
            self.recorder.write(key, boundary, _read_ring(self._rows, low, boundary))  # [b-low, C]

    def load_boundary(self, num_tokens: int, rows: torch.Tensor) -> None:
        """Stand at num_tokens with stored rows [n, Ws] as positions num_tokens-n .. num_tokens-1 (fresh store)."""
        if self.num_tokens:
            raise RuntimeError("load_boundary needs a fresh store")
        self._counter.advance(num_tokens - rows.shape[0])
        _write_ring(self._rows, self.num_tokens, rows)  # the snapshot's bytes as they are
        self._counter.advance(rows.shape[0])


class RecordingCompressorStore(CompressorStore):
    """A CompressorStore that snapshots the pending inputs the next window close needs at a block end."""

    def __init__(self, recorder: Recorder, layer: int, which: str, ratio: int, input_dim: int, row_dim: int,
                 overlap: bool, max_rollback_tokens: int, dtype, device, row_store,
                 row_format: RowFormat | None = None) -> None:
        super().__init__(ratio, input_dim, row_dim, overlap, max_rollback_tokens, dtype, device, row_store=row_store,
                         row_format=row_format)
        self.recorder = recorder
        self.layer = layer
        self.which = which
        self._recorded_write: tuple[int, int] | None = None  # (start, tokens) snapshotted by record_write

    def num_pending_at_boundary(self) -> int:
        """Inputs still needed at a block end (a multiple of the ratio): the previous window with overlap."""
        return self.ratio if self.overlap else 0

    def append_inputs(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        self.record_write(kv, score)
        self._recorded_write = None
        super().append_inputs(kv, score)

    def record_write(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Snapshot the pending inputs of every block end that writing kv / score [n, C_in]
        (positions num_tokens ..) crosses, before a kernel overwrites the rings (see the window's)."""
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
        self._recorded_write = (start, kv.shape[0])

    def mark_written(self, num_tokens: int) -> None:
        """A kernel wrote these positions' inputs into the rings: snapshot the pending inputs
        b-m .. b-1 of each crossed block end b from the rings, or poison them when overwritten."""
        start = self.num_tokens
        recorded, self._recorded_write = self._recorded_write == (start, num_tokens), None
        super().mark_written(num_tokens)
        num_pending = self.num_pending_at_boundary()
        if not num_pending or recorded:
            return
        oldest_retained = self._counter.high_water - self.ring_size
        kv_key, score_key = (self.layer, f"{self.which}_pending_kv"), (self.layer, f"{self.which}_pending_score")
        for boundary in self.recorder.boundaries(start, start + num_tokens):
            low = boundary - num_pending
            if low < oldest_retained:
                _log_lost(self.layer, self.which, boundary, start, num_tokens, self.ring_size)
                self.recorder.poison(kv_key, boundary)
                self.recorder.poison(score_key, boundary)
                continue
            self.recorder.write(kv_key, boundary, _read_ring(self._kv, low, boundary))  # [m, C_in]
            self.recorder.write(score_key, boundary, _read_ring(self._score, low, boundary))

    def load_boundary(self, num_tokens: int, kv: torch.Tensor | None, score: torch.Tensor | None) -> None:
        """Stand at num_tokens with pending inputs [n, C] of positions num_tokens-n .. (None: no
        pending inputs). Only for a fresh store."""
        if self.num_tokens:
            raise RuntimeError("load_boundary needs a fresh store")
        num_pending = 0 if kv is None else kv.shape[0]
        self._counter.advance(num_tokens - num_pending)
        if num_pending:
            super().append_inputs(kv, score)


def _log_lost(layer: int, which: str, boundary: int, start: int, num_tokens: int, ring_size: int) -> None:
    """One event per lost block end: every layer has the same geometry and the window reach is the
    shortest (compressor rings reach at least as far), so layer 0's window speaks for all."""
    if layer != 0 or which != "window":
        return
    log.warning("attention.boundary_snapshot_lost", layer=layer, store=which, boundary=boundary,
                first_position=start, num_tokens=num_tokens, ring_size=ring_size)


def recording_state(config: ModelConfig, pool: KVPool, table: BlockTable, recorder: Recorder,
                    dtype: torch.dtype, device: torch.device,
                    max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS,
                    max_chunk_tokens: int | None = None) -> SequenceState:
    """A SequenceState whose rows live in the pool (through table) and which records snapshots.

    The stores are built with the same geometry SequenceState gives its own (same input widths
    and overlap), then replace them. max_chunk_tokens: the longest kernel-path write (prefill
    chunk) whose inner block ends must be captured; the stores' rings then hold
    max(max_rollback_tokens, max_chunk_tokens) positions beyond what they need (see the module
    docstring: "Reach"). None keeps the plain rings (kernel-path block ends deeper than
    max_rollback_tokens inside a chunk are poisoned, not captured)."""
    state = SequenceState(config, max_rollback_tokens=max_rollback_tokens, dtype=dtype, device=device,
                          row_store_factory=pool.row_store_factory(table), kv_storage=pool.kv_storage)
    rows_of = pool.row_store_factory(table)
    # the stores' ring reach (their own rollback bound may exceed the state's: the ring is bigger)
    max_rollback_tokens = max(max_rollback_tokens, max_chunk_tokens or 0)
    main = state.main_row_format  # window and compressed rows as the pool stores them
    indexer = state.indexer_row_format  # the indexer rows likewise
    for layer, layer_state in enumerate(state.layers):
        layer_state.window = RecordingWindowStore(recorder, layer, config.sliding_window, config.head_dim,
                                                  max_rollback_tokens, dtype, device, row_format=main)
        ratio = config.compress_ratio(layer)
        if layer_state.kind is AttentionKind.CSA:
            layer_state.compressor = RecordingCompressorStore(
                recorder, layer, "compressor", ratio, 2 * config.head_dim, config.head_dim, True, max_rollback_tokens,
                dtype, device, rows_of(layer, "compressor", config.head_dim), row_format=main)
            layer_state.indexer = RecordingCompressorStore(
                recorder, layer, "indexer", ratio, 2 * config.index_head_dim, config.index_head_dim, True,
                max_rollback_tokens, dtype, device, rows_of(layer, "indexer", config.index_head_dim),
                row_format=indexer)
        elif layer_state.kind is AttentionKind.HCA:
            layer_state.compressor = RecordingCompressorStore(
                recorder, layer, "compressor", ratio, config.head_dim, config.head_dim, False, max_rollback_tokens,
                dtype, device, rows_of(layer, "compressor", config.head_dim), row_format=main)
    return state


def _check_captured(recorder: Recorder, state: SequenceState, snapshot_id: int, num_tokens: int) -> None:
    """Refuse a snapshot poisoned by `mark_written` (one host sync; restores are rare)."""
    for layer, layer_state in enumerate(state.layers):
        keys = [((layer, "window_snapshot"), min(num_tokens, layer_state.window.sliding_window))]
        for store in (layer_state.compressor, layer_state.indexer):
            if store is not None and store.num_pending_at_boundary():
                keys.append(((layer, f"{store.which}_pending_kv"), store.num_pending_at_boundary()))
        for key, num_rows in keys:
            snapshot = recorder.read(key, snapshot_id, num_rows)
            if key[1] == "window_snapshot":
                snapshot = layer_state.window.row_format.decode(snapshot)
            if not bool(torch.isfinite(snapshot).all()):
                raise KVPoolError(f"snapshot {snapshot_id} (boundary {num_tokens}) holds no {key}: it was "
                                  f"crossed deep inside a kernel-path chunk longer than the ring reach")


def restore_state(state: SequenceState, recorder: Recorder, num_tokens: int, snapshot_id: int) -> None:
    """Position a fresh recording state at the block boundary num_tokens from that boundary's resume snapshot
    (`snapshot_id` in the primary snapshot tier).

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
    if len(recorder.table.block_ids) < num_tokens // size:
        raise KVPoolError(f"restore at {num_tokens} tokens needs {num_tokens // size} blocks, the table has "
                          f"{len(recorder.table.block_ids)}")
    num_snapshots = recorder.pool.config.num_primary_snapshots
    if not 0 <= snapshot_id < num_snapshots:
        raise KVPoolError(f"restore from snapshot {snapshot_id}: outside the primary tier ({num_snapshots} snapshots)")
    _check_captured(recorder, state, snapshot_id, num_tokens)
    for layer, layer_state in enumerate(state.layers):
        window = layer_state.window
        num_window_rows = min(num_tokens, window.sliding_window)
        window.load_boundary(num_tokens, recorder.read((layer, "window_snapshot"), snapshot_id, num_window_rows))
        for store in (layer_state.compressor, layer_state.indexer):
            if store is None:
                continue
            num_pending = store.num_pending_at_boundary()
            if num_pending == 0:
                store.load_boundary(num_tokens, None, None)
                continue
            store.load_boundary(num_tokens,
                                recorder.read((layer, f"{store.which}_pending_kv"), snapshot_id, num_pending),
                                recorder.read((layer, f"{store.which}_pending_score"), snapshot_id, num_pending))
    state.num_tokens = num_tokens
    recorder.num_sealed_tokens = num_tokens
