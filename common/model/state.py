"""Per-sequence decode state (docs/model.md §3), laid out so that rollback is only a counter change.

One `SequenceState` per sequence holds one `LayerState` per layer:
- `WindowStore`: raw kv rows in a ring of `sliding_window + max_rollback_tokens` rows (slot = pos mod
  ring). Attention at position t needs rows t-W+1..t, so after rolling back n ≤ max_rollback tokens
  every row still needed is intact.
- `CompressorStore` (CSA/HCA main compressor; CSA indexer compressor): the projected compressor
  inputs (K, Z) of the last R·m positions in a ring (CSA also needs the previous window for the
  overlap), plus the emitted rows, append-only; `num_rows = num_tokens // ratio` so a rollback
  simply forgets rows past the new count. R is chosen from `max_rollback_tokens`.

Row storage (`SequenceState(kv_storage=...)`, common/model/kv_rows.py `RowFormat`): the window ring and the
main compressor's rows hold either rows in the activation dtype or packed FP8 main rows (uint8 [.., row_bytes]),
the CSA indexer's rows likewise rows in the activation dtype or packed FP8 indexer rows; `append` / `write_rows`
encode, `read` / `read_rows` decode, so callers see rows [n, row_dim] in the activation dtype either way. The
compressors' pending inputs are always kept as they are (fp32).

Invariant: every store of a sequence advances by the same token count per forward; the
`SequenceState.num_tokens` counter is the authority and is advanced once the whole forward is done.
Rollback is allowed while the total distance below the highest position ever reached ("high
water") stays within `max_rollback_tokens`; beyond that, ring slots may have been overwritten.
Storage is kept behind these small classes so a paged GPU/CPU pool can replace them later.

Kernel access (common/kernels/attention_layout.py): the batched attention kernels read and write
the ring tensors and row tensors in place through their device addresses, then advance the
counters with `mark_written`. Addresses of a state's own tensors change only when a row tensor
grows; every growth bumps the state's shared `LayoutVersion`, so cached address tables can tell
they are stale. `SequenceState.reserve_tokens` grows ahead of a forward so no write inside it
reallocates (a captured CUDA graph keeps writing to the addresses it was captured with).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.kv_rows import IndexerRowLayout, MainRowLayout, RowFormat
from moemesh.common.model.kv_sizing import DEFAULT_MAX_ROLLBACK_TOKENS
from moemesh.common.model.kv_storage import KVStorage


class RollbackError(ValueError):
    """Rolling back further than the state retains."""


class RowStore(Protocol):
    """Where a CompressorStore keeps its emitted rows when not in its own tensor (a paged pool).
    Rows are append-only by row index, as stored (the store's `RowFormat`: [n, Ws] of its stored dtype, Ws =
    row_dim for plain rows, row_bytes of uint8 for FP8 main rows); `read(n)` returns rows 0..n-1 [n, Ws]."""

    def write(self, first_row: int, rows: torch.Tensor) -> None: ...

    def read(self, num_rows: int) -> torch.Tensor: ...


# (layer, "compressor" | "indexer", row_dim) -> the RowStore of that compressor's rows (in the stored format:
# a state with FP8 rows checks that its row stores hold uint8 rows of row_bytes)
RowStoreFactory = Callable[[int, str, int], RowStore]


class LayoutVersion:
    """Bumped whenever a store of one sequence moves a tensor (a growing row tensor reallocated)."""

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class _RingCounter:
    """num_tokens and the high-water mark shared by the ring stores."""

    def __init__(self, max_rollback_tokens: int) -> None:
        self.num_tokens = 0
        self.high_water = 0
        self.max_rollback_tokens = max_rollback_tokens

    def check_readable(self, start_pos: int, ring_size: int, what: str) -> None:
        if start_pos < self.high_water - ring_size or start_pos < 0 or start_pos > self.num_tokens:
            raise RollbackError(
                f"{what}: position {start_pos} not retained (num_tokens={self.num_tokens}, "
                f"high_water={self.high_water}, ring={ring_size})"
            )

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > self.num_tokens:
            raise RollbackError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        if self.high_water - (self.num_tokens - num_tokens) > self.max_rollback_tokens:
            raise RollbackError(
                f"rollback to {self.num_tokens - num_tokens} is more than max_rollback_tokens="
                f"{self.max_rollback_tokens} below the high-water mark {self.high_water}"
            )
        self.num_tokens -= num_tokens

    def advance(self, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        self.high_water = max(self.high_water, self.num_tokens)


def _write_ring(ring: torch.Tensor, first_pos: int, rows: torch.Tensor) -> None:
    """rows [n, C] for positions first_pos.. into ring [S, C] at slot = pos mod S (last S rows only)."""
    ring_size = ring.shape[0]
    if rows.shape[0] > ring_size:
        first_pos += rows.shape[0] - ring_size
        rows = rows[-ring_size:]
    slots = torch.arange(first_pos, first_pos + rows.shape[0], device=ring.device) % ring_size
    ring[slots] = rows.to(ring.dtype)


def _read_ring(ring: torch.Tensor, start_pos: int, end_pos: int) -> torch.Tensor:
    slots = torch.arange(start_pos, end_pos, device=ring.device) % ring.shape[0]
    return ring[slots]


class WindowStore:
    """Raw (normed, rotated) kv rows of the sliding window. ring [ring, Ws] as stored (`row_format`)."""

    def __init__(self, sliding_window: int, row_dim: int, max_rollback_tokens: int, dtype, device,
                 row_format: RowFormat | None = None) -> None:
        """row_format: how rows are stored (None: as they are, in dtype)."""
        self.ring_size = sliding_window + max_rollback_tokens
        self.row_format = row_format or RowFormat(row_dim, dtype)
        self._rows = self.row_format.empty(self.ring_size, device)
        self._counter = _RingCounter(max_rollback_tokens)

    @property
    def num_tokens(self) -> int:
        return self._counter.num_tokens

    def read(self, start_pos: int) -> torch.Tensor:
        """Rows of positions start_pos .. num_tokens-1 -> [n, C] (decoded)."""
        self._counter.check_readable(start_pos, self.ring_size, "window")
        return self.row_format.decode(_read_ring(self._rows, start_pos, self.num_tokens))

    def append(self, rows: torch.Tensor) -> None:
        """rows [n, C] for positions num_tokens .. num_tokens+n-1."""
        kept = rows[-self.ring_size:]  # earlier rows would be overwritten within this append
        _write_ring(self._rows, self.num_tokens + rows.shape[0] - kept.shape[0], self.row_format.encode(kept))
        self._counter.advance(rows.shape[0])

    def rollback(self, num_tokens: int) -> None:
        self._counter.rollback(num_tokens)

    @property
    def ring(self) -> torch.Tensor:
        """The ring tensor [ring_size, Ws] as stored (never reallocated), for kernels writing in place."""
        return self._rows

    def mark_written(self, num_tokens: int) -> None:
        """Advance the counter after a kernel wrote positions num_tokens .. +num_tokens-1 into `ring`."""
        self._counter.advance(num_tokens)

    def live_tensors(self, window: int) -> dict[str, torch.Tensor]:
        start = max(0, self.num_tokens - window + 1)
        return {"window": self.read(start)}


class CompressorStore:
    """Pending compressor inputs (K, Z per position) and emitted rows of one compressor.

    inputs ring [R·m, C_in] fp32 (C_in = c·row_dim, c = 2 with overlap); rows [capacity, Ws] as stored
    (`row_format`; Ws = row_dim for plain rows, row_bytes for FP8 main rows).
    """

    def __init__(self, ratio: int, input_dim: int, row_dim: int, overlap: bool, max_rollback_tokens: int,
                 dtype, device, initial_row_capacity: int = 64, row_store: "RowStore | None" = None,
                 layout_version: LayoutVersion | None = None, row_format: RowFormat | None = None) -> None:
        """row_format: how the emitted rows are stored (None: as they are, in dtype)."""
        self.ratio = ratio
        self.overlap = overlap
        # positions still needed after a rollback of max_rollback_tokens: the open window, plus the
        # previous window when overlapping -> up to max_rollback + 2m - 1 (or + m - 1) positions back.
        needed = max_rollback_tokens + (2 * ratio - 1 if overlap else ratio - 1)
        self.ring_size = max(math.ceil(needed / ratio), 2 if overlap else 1) * ratio
        self._kv = torch.zeros(self.ring_size, input_dim, dtype=torch.float32, device=device)
        self._score = torch.zeros(self.ring_size, input_dim, dtype=torch.float32, device=device)
        # emitted rows live in `row_store` when given (a paged KV pool), else in a growing tensor
        self._row_store = row_store
        self.row_format = row_format or RowFormat(row_dim, dtype)
        self._rows = None if row_store is not None else self.row_format.empty(initial_row_capacity, device)
        self._counter = _RingCounter(max_rollback_tokens)
        self.layout_version = layout_version or LayoutVersion()

    @property
    def num_tokens(self) -> int:
        return self._counter.num_tokens

    @property
    def row_store(self) -> "RowStore | None":
        """The external store of the rows (a paged pool), or None when they live in `own_rows`."""
        return self._row_store

    @property
    def own_rows(self) -> torch.Tensor | None:
        """The whole own row tensor [capacity, Ws] as stored (None with an external row store)."""
        return self._rows

    @property
    def input_rings(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K ring, Z ring), each [ring_size, C_in] fp32, slot = position mod ring_size (never reallocated)."""
        return self._kv, self._score

    def reserve_rows(self, num_rows: int) -> None:
        """Grow the own row tensor to hold at least num_rows rows (no-op with an external store)."""
        if self._rows is not None and num_rows > self._rows.shape[0]:
            self._grow(max(num_rows, 2 * self._rows.shape[0]))

    def _grow(self, capacity: int) -> None:
        grown = torch.zeros(capacity, self._rows.shape[1], dtype=self._rows.dtype, device=self._rows.device)
        grown[: self._rows.shape[0]] = self._rows
        self._rows = grown
        self.layout_version.bump()

    def mark_written(self, num_tokens: int) -> None:
        """Advance the counter after a kernel wrote these positions' inputs (and closed rows) in place."""
        self._counter.advance(num_tokens)

    @property
    def num_rows(self) -> int:
        return self.num_tokens // self.ratio

    def first_needed_position(self) -> int:
        """First position whose inputs the next window close needs (open window, or the one before)."""
        open_window = self.num_tokens // self.ratio
        return max(0, (open_window - (1 if self.overlap else 0)) * self.ratio)

    def read_inputs(self, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, Z) of positions start_pos .. num_tokens-1, each [n, C_in] fp32."""
        self._counter.check_readable(start_pos, self.ring_size, "compressor inputs")
        return _read_ring(self._kv, start_pos, self.num_tokens), _read_ring(self._score, start_pos, self.num_tokens)

    def append_inputs(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        _write_ring(self._kv, self.num_tokens, kv.float())
        _write_ring(self._score, self.num_tokens, score.float())
        self._counter.advance(kv.shape[0])

    def write_rows(self, first_row: int, rows: torch.Tensor) -> None:
        """rows [n, row_dim] as rows first_row.. (must not be past num_rows when called)."""
        stored = self.row_format.encode(rows)  # [n, Ws]
        if self._row_store is not None:
            self._row_store.write(first_row, stored)
            return
        end = first_row + rows.shape[0]
        self.reserve_rows(end)
        self._rows[first_row:end] = stored

    def read_rows(self) -> torch.Tensor:
        """All emitted rows of this sequence -> [num_rows, row_dim] (decoded)."""
        if self._row_store is not None:
            return self.row_format.decode(self._row_store.read(self.num_rows))
        return self.row_format.decode(self._rows[: self.num_rows])

    def rollback(self, num_tokens: int) -> None:
        self._counter.rollback(num_tokens)

    def live_tensors(self) -> dict[str, torch.Tensor]:
        kv, score = self.read_inputs(self.first_needed_position())
        return {"rows": self.read_rows(), "pending_kv": kv, "pending_score": score}


@dataclass
class LayerState:
    kind: AttentionKind
    window: WindowStore
    compressor: CompressorStore | None = None
    indexer: CompressorStore | None = None  # CSA only

    def stores(self) -> list[WindowStore | CompressorStore]:
        return [s for s in (self.window, self.compressor, self.indexer) if s is not None]


class SequenceState:
    """Everything one sequence needs to continue: per-layer stores and the token count."""

    def __init__(self, config: ModelConfig, *, max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 row_store_factory: RowStoreFactory | None = None, kv_storage: KVStorage = KVStorage.BF16) -> None:
        """dtype: the activation dtype (what reads return); row_store_factory: where compressed rows live
        (default: a growing tensor per store); kv_storage: how window and compressed rows are stored."""
        self.config = config
        self.dtype = dtype
        self.kv_storage = kv_storage
        main = RowFormat.main(config, kv_storage, dtype)
        indexer = RowFormat.indexer(config, kv_storage, dtype)
        self.main_row_format = main
        self.indexer_row_format = indexer

        def rows(layer: int, which: str, row_dim: int) -> RowStore | None:
            if row_store_factory is None:
                return None
            store = row_store_factory(layer, which, row_dim)
            row_format = main if which == "compressor" else indexer
            if row_format.layout is not None:
                _check_stored_format(store, row_format, f"layer {layer} {which}")
            return store

        self.max_rollback_tokens = max_rollback_tokens
        self.num_tokens = 0
        self.layout_version = LayoutVersion()
        self._reserved_tokens = 0  # own row tensors hold at least this many tokens' rows
        # device address tables of this state's stores, owned by common.kernels.attention_layout
        self.address_cache: object | None = None
        self._store_counters: list | None = None  # every store's counter, for commit_kernel_writes
        self.layers: list[LayerState] = []
        for layer, kind in enumerate(config.layer_types):
            window = WindowStore(config.sliding_window, config.head_dim, max_rollback_tokens, dtype, device,
                                 row_format=main)
            state = LayerState(kind, window)
            ratio = config.compress_ratio(layer)
            if kind is AttentionKind.CSA:
                state.compressor = CompressorStore(ratio, 2 * config.head_dim, config.head_dim, True,
                                                   max_rollback_tokens, dtype, device,
                                                   row_store=rows(layer, "compressor", config.head_dim),
                                                   layout_version=self.layout_version, row_format=main)
                state.indexer = CompressorStore(ratio, 2 * config.index_head_dim, config.index_head_dim, True,
                                                max_rollback_tokens, dtype, device,
                                                row_store=rows(layer, "indexer", config.index_head_dim),
                                                layout_version=self.layout_version, row_format=indexer)
            elif kind is AttentionKind.HCA:
                state.compressor = CompressorStore(ratio, config.head_dim, config.head_dim, False,
                                                   max_rollback_tokens, dtype, device,
                                                   row_store=rows(layer, "compressor", config.head_dim),
                                                   layout_version=self.layout_version, row_format=main)
            self.layers.append(state)

    @property
    def main_row_layout(self) -> MainRowLayout | None:
        """The FP8 layout of the window and compressed rows, or None when they are kept in `dtype`."""
        return self.main_row_format.layout

    @property
    def indexer_row_layout(self) -> IndexerRowLayout | None:
        """The FP8 layout of the CSA indexer's rows, or None when they are kept in `dtype`."""
        return self.indexer_row_format.layout

    def advance(self, num_tokens: int) -> None:
        """Called once a forward over num_tokens new tokens has updated every layer."""
        target = self.num_tokens + num_tokens
        for layer, state in enumerate(self.layers):
            for store in state.stores():
                if store.num_tokens != target:
                    raise RuntimeError(f"layer {layer} store at {store.num_tokens} tokens, expected {target}")
        self.num_tokens = target

    def commit_kernel_writes(self, num_tokens: int) -> None:
        """Advance every store and the state by num_tokens after kernels wrote them in place outside any
        forward's bookkeeping (a replayed CUDA graph of a decode step: services/attention/graph_decode.py).
        Equivalent to `mark_written` on each store, then `advance`, in one pass over the stores' counters
        (a decode step of 64 sequences over 43 layers touches ~7,000 of them: this runs on the host per step).
        Stores whose class overrides `mark_written` (a hook, e.g. snapshots at block ends) get the call."""
        if self._store_counters is None:
            plain = {WindowStore.mark_written, CompressorStore.mark_written}
            stores = [store for state in self.layers for store in state.stores()]
            self._store_counters = ([store._counter for store in stores if type(store).mark_written in plain],
                                    [store for store in stores if type(store).mark_written not in plain])
        counters, hooked = self._store_counters
        for counter in counters:
            counter.num_tokens += num_tokens
            if counter.num_tokens > counter.high_water:
                counter.high_water = counter.num_tokens
        for store in hooked:
            store.mark_written(num_tokens)
        self.num_tokens += num_tokens

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens tokens exactly (speculative verification)."""
        if num_tokens == 0:
            return
        for state in self.layers:
            for store in state.stores():
                store.rollback(num_tokens)
        self.num_tokens -= num_tokens

    def reserve_tokens(self, num_tokens: int) -> None:
        """Make every own row tensor hold the rows of num_tokens tokens, so writes up to there
        never reallocate (kernels write through cached addresses)."""
        if num_tokens <= self._reserved_tokens:
            return
        target = max(num_tokens, 2 * self._reserved_tokens, 256)  # doubling: rare reallocations
        for layer_state in self.layers:
            for store in (layer_state.compressor, layer_state.indexer):
                if store is not None:
                    store.reserve_rows(target // store.ratio)
        self._reserved_tokens = target

    def clone(self) -> "SequenceState":
        """A deep copy (new tensors, hence no cached addresses: see `__deepcopy__`)."""
        import copy

        return copy.deepcopy(self)

    def __deepcopy__(self, memo):
        import copy

        twin = SequenceState.__new__(SequenceState)
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            setattr(twin, name, None if name in ("address_cache", "_store_counters") else copy.deepcopy(value, memo))
        return twin

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the next step can read, by name, rows decoded (for state-equality tests)."""
        out: dict[str, torch.Tensor] = {}
        for layer, state in enumerate(self.layers):
            for name, tensor in state.window.live_tensors(self.config.sliding_window).items():
                out[f"layers.{layer}.{name}"] = tensor
            for prefix, store in (("compressor", state.compressor), ("indexer", state.indexer)):
                if store is not None:
                    for name, tensor in store.live_tensors().items():
                        out[f"layers.{layer}.{prefix}.{name}"] = tensor
        return out


def _check_stored_format(store: RowStore, row_format: RowFormat, what: str) -> None:
    """A row store must hold rows as `row_format` stores them: the empty read of one tells [0, Ws] and dtype."""
    probe = store.read(0)
    if probe.dtype != row_format.stored_dtype or probe.shape[-1] != row_format.stored_width:
        kind = "main" if isinstance(row_format.layout, MainRowLayout) else "indexer"
        raise ValueError(f"{what}: the row store holds [.., {probe.shape[-1]}] {probe.dtype} rows; FP8 {kind} rows "
                         f"need [.., {row_format.stored_width}] {row_format.stored_dtype} (a KV pool built with "
                         f"the same kv storage)")
