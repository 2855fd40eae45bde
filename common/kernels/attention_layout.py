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
Legend: L layers, B sequences, T tokens, F fields, NB blocks per sequence, Nc closing tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.state import CompressorStore, SequenceState

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


@dataclass(frozen=True)
class RowsLocation:
    """Where one store's compressed rows live: base address, rows per block (None: contiguous)
    and, for a paged store, the block ids of the sequence."""

    address: int
    rows_per_block: int | None = None
    block_ids: tuple[int, ...] = ()


def rows_location(store: CompressorStore, dtype: torch.dtype) -> RowsLocation | None:
    """The rows of `store` as the kernels address them, or None when they cannot be addressed in
    place (an unknown row store): the caller then keeps the torch path.

    Known layouts: the store's own tensor; a row store exposing `pool` [blocks, P, d] plus
    `rows_per_block` and `table.block_ids` (services/attention/kv_pool.PagedRowStore); a row store
    whose `read(1)` is a view into one fixed contiguous tensor (random_init.PreallocatedRowStore).
    Rows of another dtype than `dtype` (the window ring's) are not addressable either.
    TODO(owners of those stores): a `rows_location()` method on RowStore would replace the probing."""
    if store.own_rows is not None:
        return RowsLocation(store.own_rows.data_ptr()) if store.own_rows.dtype == dtype else None
    row_store = store.row_store
    pool = getattr(row_store, "pool", None)
    table = getattr(row_store, "table", None)
    if isinstance(pool, torch.Tensor) and table is not None and pool.is_contiguous() and pool.dtype == dtype:
        return RowsLocation(pool.data_ptr(), int(row_store.rows_per_block), tuple(table.block_ids))
    try:
        view = row_store.read(1)  # (an empty view reports data_ptr 0)
    except (IndexError, RuntimeError, ValueError):
        return None
    base = getattr(view, "_base", None)
    if (isinstance(base, torch.Tensor) and base.is_contiguous() and base.dim() == 2 and base.dtype == dtype
            and view.data_ptr() == base.data_ptr()):
        return RowsLocation(base.data_ptr())
    return None


@dataclass
class _SequenceAddresses:
    """Cached on `SequenceState.address_cache`: valid while the state's layout version holds."""

    layout_version: int
    fields: torch.Tensor  # [L, F] int64 (CPU)
    paged: bool
    rows_per_block: dict[tuple[int, str], int]
    block_table: object | None  # the paged stores' BlockTable (block ids change per plan)


def _store_fields(store: CompressorStore) -> tuple[int, int, int]:
    kv, score = store.input_rings
    return kv.data_ptr(), score.data_ptr(), kv.shape[0]


def sequence_addresses(state: SequenceState) -> _SequenceAddresses | None:
    """The [L, F] address table of one state (cached), or None when a store is not addressable."""
    cache = state.address_cache
    if isinstance(cache, _SequenceAddresses) and cache.layout_version == state.layout_version.value:
        return cache
    fields = [[0] * NUM_FIELDS for _ in state.layers]
    rows_per_block: dict[tuple[int, str], int] = {}
    paged_flags = set()
    block_table = None
    for layer, layer_state in enumerate(state.layers):
        row = fields[layer]
        row[Field.WINDOW_ADDR] = layer_state.window.ring.data_ptr()
        row[Field.WINDOW_RING] = layer_state.window.ring_size
        for which, store, (rows_f, kv_f, score_f, ring_f) in (
                ("compressor", layer_state.compressor,
                 (Field.ROWS_ADDR, Field.INPUT_KV_ADDR, Field.INPUT_SCORE_ADDR, Field.INPUT_RING)),
                ("indexer", layer_state.indexer,
                 (Field.INDEX_ROWS_ADDR, Field.INDEX_INPUT_KV_ADDR, Field.INDEX_INPUT_SCORE_ADDR,
                  Field.INDEX_INPUT_RING))):
            if store is None:
                continue
            location = rows_location(store, layer_state.window.ring.dtype)
            if location is None:
                return None
            paged_flags.add(location.rows_per_block is not None)
            if location.rows_per_block is not None:
                block_table = store.row_store.table
            rows_per_block[(layer, which)] = location.rows_per_block or CONTIGUOUS_ROWS_PER_BLOCK
            row[rows_f] = location.address
            row[kv_f], row[score_f], row[ring_f] = _store_fields(store)
    if len(paged_flags) > 1:
        return None  # paged and contiguous stores mixed in one sequence: not addressable uniformly
    cache = _SequenceAddresses(state.layout_version.value, torch.tensor(fields, dtype=torch.int64),
                               bool(paged_flags) and paged_flags.pop(),
                               rows_per_block, block_table)
    state.address_cache = cache
    return cache


class AttentionTables:
    """The device tables of one forward (see the module docstring). Build with `build_tables`."""

    def __init__(self, fields: torch.Tensor, seq_info: torch.Tensor, token_seq: torch.Tensor,
                 positions: torch.Tensor, block_ids: torch.Tensor, rows_per_block: dict[tuple[int, str], int],
                 closing: dict[int, tuple[torch.Tensor, int]], max_rows_visible: dict[int, int],
                 max_position: int, state_dtype: torch.dtype) -> None:
        self.state_dtype = state_dtype  # dtype of every ring and row store of the forward
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


def build_tables(config: ModelConfig, states: list[SequenceState], start_positions: list[int],
                 num_new_tokens: list[int], positions: torch.Tensor) -> AttentionTables | None:
    """Tables for one forward over `states` (None when some store is not addressable in place)."""
    device = positions.device
    per_sequence = []
    for state, start, count in zip(states, start_positions, num_new_tokens):
        state.reserve_tokens(start + count)
        addresses = sequence_addresses(state)
        if addresses is None:
            return None
        per_sequence.append(addresses)
    if len({a.paged for a in per_sequence}) > 1:
        return None
    dtypes = {state.layers[0].window.ring.dtype for state in states}
    if len(dtypes) > 1:
        return None
    rows_per_block = dict(per_sequence[0].rows_per_block)
    for addresses in per_sequence[1:]:
        if addresses.rows_per_block != rows_per_block:
            return None
    fields = torch.stack([a.fields for a in per_sequence], dim=1)  # [L, B, F]
    if per_sequence[0].paged:
        tables = [tuple(a.block_table.block_ids) for a in per_sequence]
        geometries = {(config.compress_ratio(layer), per_block) for (layer, _), per_block in rows_per_block.items()}
        for ids, start, count in zip(tables, start_positions, num_new_tokens):
            for ratio, per_block in geometries:  # the kernels do not bounds-check block ids
                if len(ids) * per_block < (start + count) // ratio:
                    raise ValueError(f"block table of {len(ids)} blocks does not hold the {(start + count) // ratio} "
                                     f"rows of ratio {ratio} up to position {start + count - 1}")
        width = max(1, max(len(ids) for ids in tables))
        block_ids = torch.zeros(len(tables), width, dtype=torch.int64)
        for row, ids in enumerate(tables):
            block_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    else:
        block_ids = torch.zeros(len(states), 1, dtype=torch.int64)
    seq_info = torch.zeros(len(states), 3, dtype=torch.int64)
    token_seq = torch.empty(sum(num_new_tokens), dtype=torch.int32)
    offset = 0
    for index, (start, count) in enumerate(zip(start_positions, num_new_tokens)):
        seq_info[index, 0], seq_info[index, 1], seq_info[index, 2] = start, offset, count
        token_seq[offset: offset + count] = index
        offset += count
    ratios = sorted({config.compress_ratio(layer) for layer, kind in enumerate(config.layer_types)
                     if kind is not AttentionKind.WINDOW})
    closing: dict[int, tuple[torch.Tensor, int]] = {}
    max_rows: dict[int, int] = {}
    for ratio in ratios:
        flat = []
        offset = 0
        for start, count in zip(start_positions, num_new_tokens):
            first_close = -(-(start + 1) // ratio) * ratio - 1  # first p >= start with (p+1) % m == 0
            flat.extend(offset + p - start for p in range(first_close, start + count, ratio))
            offset += count
        closing[ratio] = (torch.tensor(flat, dtype=torch.int64).to(device), len(flat))
        max_rows[ratio] = max((start + count) // ratio for start, count in zip(start_positions, num_new_tokens))
    max_position = max(start + count - 1 for start, count in zip(start_positions, num_new_tokens))
    return AttentionTables(fields.to(device), seq_info.to(device), token_seq.to(device), positions,
                           block_ids.to(device),
                           rows_per_block, closing, max_rows, max_position, dtypes.pop())
