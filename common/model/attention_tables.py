"""The kernels' attention tables (common/kernels/attention_layout.py) built from sequence states.

`sequence_addresses` reads one `SequenceState`'s store addresses into its [L, F] field table
(cached on the state while its layout holds); `build_tables` stacks those of one forward's
sequences and adds the per-token and per-ratio tables. Either gives None when some store cannot
be addressed in place, and the caller keeps the torch path.
Legend: L layers, B sequences, T tokens, F fields, NB blocks per sequence, Nc closing tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.common.kernels.attention_layout import CONTIGUOUS_ROWS_PER_BLOCK, NUM_FIELDS, AttentionTables, Field
from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.state import CompressorStore, SequenceState


@dataclass(frozen=True)
class RowsLocation:
    """Where one store's compressed rows live: base address, rows per block (None: contiguous)
    and, for a paged store, the block ids of the sequence."""

    address: int
    rows_per_block: int | None = None
    block_ids: tuple[int, ...] = ()


def rows_location(store: CompressorStore) -> RowsLocation | None:
    """The rows of `store` as the kernels address them, or None when they cannot be addressed in
    place (an unknown row store): the caller then keeps the torch path.

    Known layouts: the store's own tensor; a row store exposing `pool` [blocks, P, d] plus
    `rows_per_block` and `table.block_ids` (services/attention/kv_pool.PagedRowStore); a row store
    whose `read(1)` is a view into one fixed contiguous tensor (random_init.PreallocatedRowStore).
    Rows held in another dtype than the store's format stores them in (`row_format.stored_dtype`: the
    activation dtype, or uint8 FP8 rows) are not addressable either.
    TODO(owners of those stores): a `rows_location()` method on RowStore would replace the probing."""
    dtype = store.row_format.stored_dtype
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
            location = rows_location(store)
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
    formats = {(state.dtype, state.main_row_layout, state.indexer_row_layout) for state in states}
    if len(formats) > 1:
        return None  # the kernels of one forward read one activation dtype and one row format
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
    state_dtype, main_rows, indexer_rows = formats.pop()
    return AttentionTables(fields.to(device), seq_info.to(device), token_seq.to(device), positions,
                           block_ids.to(device), rows_per_block, closing, max_rows, max_position, state_dtype,
                           main_rows=main_rows, indexer_rows=indexer_rows)
