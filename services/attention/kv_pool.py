"""The attention worker's KV tiers: a paged primary pool on the compute device and a CPU pool.

What is paged is the growing part of a sequence's state: the compressed rows of every CSA /
HCA compressor and of every CSA indexer (docs/design.md §4). The fixed part (window ring, open
compressor inputs) stays in the sequence's slot (`slots.py`). A block holds the rows of
`block_size_tokens` consecutive positions for every such compressor: block b of a sequence's
table covers positions [b·B, (b+1)·B) and so rows [b·B/m, (b+1)·B/m) of a ratio-m compressor.
B must be a multiple of every ratio, so a compressor window never straddles two blocks.

Resume snapshots: what a sequence needs to resume at a block end besides its blocks lives in a
separate, smaller pool of snapshots (`boundary.py` writes and reads them): per layer the raw
window rows of the last W positions (`(layer, "window_snapshot")` [snapshots, W, Ws]) and, per
overlapping (CSA) compressor, the pending inputs of the last m positions
(`(layer, "<which>_pending_kv" | "<which>_pending_score")` [snapshots, m, C] fp32; a
non-overlapping compressor whose ratio divides B has none). The router hands a sequence a
snapshot only for the block ends it wants to resume from (the last one it crossed, and those it
keeps for the prefix cache), so a context token costs only its rows. `snapshot_primary` /
`snapshot_cpu` hold them per tier; swaps move them by their own pairs.

Row storage (`KVPoolConfig.kv_storage`): compressed rows, indexer rows and window snapshots are kept as the
sequence states keep them (common/model/kv_rows.py `RowFormat`): in the activation dtype, or as packed FP8 rows
(uint8 [.., row_bytes]: 584-byte main rows and 132-byte indexer rows for V4-Flash); pending inputs stay in fp32.
Every copy below (swaps, snapshots) moves those bytes as they are.

Sizing: the tensors of a block and of a snapshot are those `common.model.kv_sizing.block_segments` lists
(`KVPool.sizing`: bytes and tokens per layer type, the same arithmetic the start-up memory budget and
`moemesh bench kv-bytes` use).

Tiers: `primary[seg]` [num_primary_blocks, B/m, Ws] on the compute device, `cpu[seg]`
[num_cpu_blocks, B/m, Ws] in host memory (pinned when the device is CUDA), and the snapshots
likewise. The router decides which block and snapshot is where; this pool only moves bytes as
the StepPlan says: `swap_out` (primary -> cpu) then `swap_in` (cpu -> primary), blocks and
snapshots, all before the step's compute.

Ordering on CUDA: copies run on a side stream. The side stream first waits for an event
recorded on the compute stream (so a block is copied only after every kernel writing it is
done), and the compute stream then waits for an event recorded after the copies (so nothing
reads a swapped-in block, or overwrites a swapped-out one, before its copy finished). No host
sync is needed. On the CPU the copies are plain synchronous copies.
Legend: B tokens per block, m compression ratio, R = B/m rows per block, W sliding window,
hd head dim, C compressor input dim, Ws stored row width (d, or row_bytes for FP8 main rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
import torch

from moemesh.common.model.config import ModelConfig
from moemesh.common.model.kv_rows import RowFormat
from moemesh.common.model.kv_sizing import Element, KVPoolSizing
from moemesh.services.attention.kv_config import KVPoolConfig

log = structlog.get_logger("attention")


class KVPoolError(RuntimeError):
    """A block table that does not cover a row, or a block id outside its tier."""


class BlockTable:
    """A sequence's primary-tier block ids, replaced by each plan that schedules the sequence."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.block_ids: tuple[int, ...] = ()
        self.ids_tensor = torch.zeros(0, dtype=torch.long, device=device)  # [num_blocks]

    def update(self, block_ids: Sequence[int]) -> None:
        block_ids = tuple(block_ids)
        if block_ids != self.block_ids:
            self.block_ids = block_ids
            self.ids_tensor = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)


class PagedRowStore:
    """The rows of one compressor of one sequence, in the primary tier blocks of its table (as stored)."""

    def __init__(self, pool: torch.Tensor, rows_per_block: int, table: BlockTable) -> None:
        self.pool = pool  # [num_primary_blocks, R, Ws]
        self.rows_per_block = rows_per_block
        self.table = table

    def _locate(self, first_row: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        end_block = -(-(first_row + num_rows) // self.rows_per_block)
        if end_block > len(self.table.block_ids):
            raise KVPoolError(f"rows up to {first_row + num_rows} need {end_block} blocks, "
                              f"the table has {len(self.table.block_ids)}")
        rows = torch.arange(first_row, first_row + num_rows, device=self.pool.device)  # [n]
        return self.table.ids_tensor[rows // self.rows_per_block], rows % self.rows_per_block

    def write(self, first_row: int, rows: torch.Tensor) -> None:
        """rows [n, Ws] as rows first_row .. first_row+n-1."""
        if (rows.dtype == torch.uint8) != (self.pool.dtype == torch.uint8):
            raise KVPoolError(f"{rows.dtype} rows into a pool of {self.pool.dtype} rows: the pool and the state "
                              f"store rows differently")
        blocks, offsets = self._locate(first_row, rows.shape[0])
        self.pool[blocks, offsets] = rows.to(self.pool.dtype)

    def read(self, num_rows: int) -> torch.Tensor:
        """Rows 0 .. num_rows-1 -> [num_rows, Ws] (a gathered copy)."""
        blocks, offsets = self._locate(0, num_rows)
        return self.pool[blocks, offsets]


class KVPool:
    def __init__(self, model_config: ModelConfig, config: KVPoolConfig, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        """dtype: the activation dtype (the rows unless config.kv_storage is FP8)."""
        self.config = config
        self.kv_storage = config.kv_storage
        self.main_row_format = RowFormat.main(model_config, config.kv_storage, dtype)
        self.indexer_row_format = RowFormat.indexer(model_config, config.kv_storage, dtype)
        self.device = torch.device(device)
        self.sizing = KVPoolSizing.of(model_config, block_size_tokens=config.block_size_tokens,
                                      num_primary_blocks=config.num_primary_blocks,
                                      num_cpu_blocks=config.num_cpu_blocks, kv_storage=config.kv_storage,
                                      activation_bytes=torch.empty((), dtype=dtype).element_size(),
                                      num_primary_snapshots=config.num_primary_snapshots,
                                      num_cpu_snapshots=config.num_cpu_snapshots)
        pin = self.device.type == "cuda"
        element_dtypes = {Element.FP8_BYTE: torch.uint8, Element.ACTIVATION: dtype, Element.FLOAT32: torch.float32}

        def tier(segments, num_entries: int, device, pin_memory: bool) -> dict[tuple[int, str], torch.Tensor]:
            return {segment.key: torch.zeros(num_entries, segment.num_rows, segment.width,
                                             dtype=element_dtypes[segment.element], device=device,
                                             pin_memory=pin_memory)  # [entries, rows, Ws]
                    for segment in segments}

        rows, snapshots = self.sizing.row_segments, self.sizing.snapshot_segments
        self.primary = tier(rows, config.num_primary_blocks, self.device, False)
        self.cpu = tier(rows, config.num_cpu_blocks, "cpu", pin)
        self.snapshot_primary = tier(snapshots, config.num_primary_snapshots, self.device, False)
        self.snapshot_cpu = tier(snapshots, config.num_cpu_snapshots, "cpu", pin)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0

    def row_store_factory(self, table: BlockTable):
        """For SequenceState(row_store_factory=...): the paged stores of one sequence."""
        def factory(layer: int, which: str, row_dim: int) -> PagedRowStore:
            pool = self.primary[(layer, which)]
            return PagedRowStore(pool, pool.shape[1], table)
        return factory

    def num_bytes_per_block(self) -> int:
        """Bytes of one block in each tier (its compressed and indexer rows), as allocated."""
        return sum(t.shape[1:].numel() * t.element_size() for t in self.primary.values())

    def num_bytes_per_snapshot(self) -> int:
        """Bytes of one resume snapshot in each tier, as allocated."""
        return sum(t.shape[1:].numel() * t.element_size() for t in self.snapshot_primary.values())

    def _check(self, pairs: Sequence[tuple[int, int]], source_blocks: int, target_blocks: int, what: str) -> None:
        for source, target in pairs:
            if not (0 <= source < source_blocks and 0 <= target < target_blocks):
                raise KVPoolError(f"{what} ({source}, {target}) is outside the tiers "
                                  f"({source_blocks}, {target_blocks} blocks)")

    def move(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]],
             snapshot_swap_out: Sequence[tuple[int, int]] = (),
             snapshot_swap_in: Sequence[tuple[int, int]] = ()) -> None:
        """swap_out (primary, cpu) pairs, then swap_in (cpu, primary) pairs, of blocks and of snapshots; ordered as
        the module says."""
        if not (swap_out or swap_in or snapshot_swap_out or snapshot_swap_in):
            return
        config = self.config
        self._check(swap_out, config.num_primary_blocks, config.num_cpu_blocks, "swap_out")
        self._check(swap_in, config.num_cpu_blocks, config.num_primary_blocks, "swap_in")
        self._check(snapshot_swap_out, config.num_primary_snapshots, config.num_cpu_snapshots, "snapshot swap_out")
        self._check(snapshot_swap_in, config.num_cpu_snapshots, config.num_primary_snapshots, "snapshot swap_in")
        moves = ((self.primary, self.cpu, swap_out, swap_in),
                 (self.snapshot_primary, self.snapshot_cpu, snapshot_swap_out, snapshot_swap_in))
        if self._copy_stream is None:
            self._copy(moves, non_blocking=False)
        else:
            compute = torch.cuda.current_stream(self.device)
            self._copy_stream.wait_stream(compute)  # = an event recorded on compute, waited on the side
            with torch.cuda.stream(self._copy_stream):
                self._copy(moves, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            compute.wait_event(done)
        self.num_blocks_swapped_out += len(swap_out)
        self.num_blocks_swapped_in += len(swap_in)
        log.debug("attention.kv_moved", num_swapped_out=len(swap_out), num_swapped_in=len(swap_in),
                  num_snapshots_swapped_out=len(snapshot_swap_out), num_snapshots_swapped_in=len(snapshot_swap_in))

    @staticmethod
    def _copy(moves, non_blocking: bool) -> None:
        for primary_tier, cpu_tier, swap_out, swap_in in moves:
            for key, primary in primary_tier.items():
                cpu = cpu_tier[key]
                for primary_entry, cpu_entry in swap_out:
                    cpu[cpu_entry].copy_(primary[primary_entry], non_blocking=non_blocking)
                for cpu_entry, primary_entry in swap_in:
                    primary[primary_entry].copy_(cpu[cpu_entry], non_blocking=non_blocking)
