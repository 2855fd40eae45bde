"""The attention worker's KV tiers: a paged primary pool on the compute device and a CPU pool.

What is paged is the growing part of a sequence's state: the compressed rows of every CSA /
HCA compressor and of every CSA indexer (docs/design.md §4). The fixed part (window ring, open
compressor inputs) stays in the sequence's slot (`slots.py`). A block holds the rows of
`block_size_tokens` consecutive positions for every such compressor: block b of a sequence's
table covers positions [b·B, (b+1)·B) and so rows [b·B/m, (b+1)·B/m) of a ratio-m compressor.
B must be a multiple of every ratio, so a compressor window never straddles two blocks.

Boundary snapshots: a block also holds what a sequence needs to resume at the block's end
(`boundary.py` writes and reads them): per layer the raw window rows of the last W positions
(`(layer, "window_snapshot")` [blocks, W, Ws]) and, per overlapping (CSA) compressor, the
pending inputs of the last m positions (`(layer, "<which>_pending_kv" | "<which>_pending_score")`
[blocks, m, C] fp32; a non-overlapping compressor whose ratio divides B has none). They are
ordinary entries of the tier dicts, so swap_out / swap_in move them with the block.

Row storage (`KVPoolConfig.kv_storage`): compressed rows, indexer rows and window snapshots are kept as the
sequence states keep them (common/model/kv_rows.py `RowFormat`): in the activation dtype, or as packed FP8 rows
(uint8 [.., row_bytes]: 584-byte main rows and 132-byte indexer rows for V4-Flash); pending inputs stay in fp32.
Every copy below (swaps, snapshots) moves those bytes as they are.

Sizing: the tensors of a block are those `common.model.kv_sizing.block_segments` lists (`KVPool.sizing`: bytes
and tokens per layer type, the same arithmetic the start-up memory budget and `moemesh bench kv-bytes` use).

Tiers: `primary[seg]` [num_primary_blocks, B/m, Ws] on the compute device, `cpu[seg]`
[num_cpu_blocks, B/m, Ws] in host memory (pinned when the device is CUDA). The router decides
which block is where; this pool only moves bytes as the StepPlan says: `swap_out` (primary ->
cpu) then `swap_in` (cpu -> primary), both before the step's compute.

Ordering on CUDA: copies run on a side stream. The side stream first waits for an event
recorded on the compute stream (so a block is copied only after every kernel writing it is
done), and the compute stream then waits for an event recorded after the copies (so nothing
reads a swapped-in block, or overwrites a swapped-out one, before its copy finished). No host
sync is needed. On the CPU the copies are plain synchronous copies.
Legend: B tokens per block, m compression ratio, d row dim, R = B/m rows per block, W sliding window,
hd head dim, C compressor input dim, Ws stored row width (d, or row_bytes for FP8 main rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import torch

from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.kv_rows import RowFormat
from moemesh.common.model.kv_sizing import Element, KVPoolSizing
from moemesh.services.attention.kv_config import KVPoolConfig

log = structlog.get_logger("attention")


class KVPoolError(RuntimeError):
    """A block table that does not cover a row, or a block id outside its tier."""


@dataclass(frozen=True)
class Segment:
    """One compressor's rows inside a block."""

    layer: int
    which: str  # "compressor" | "indexer"
    ratio: int
    row_dim: int


def pool_segments(config: ModelConfig) -> list[Segment]:
    segments = []
    for layer, kind in enumerate(config.layer_types):
        ratio = config.compress_ratio(layer)
        if kind in (AttentionKind.CSA, AttentionKind.HCA):
            segments.append(Segment(layer, "compressor", ratio, config.head_dim))
        if kind is AttentionKind.CSA:
            segments.append(Segment(layer, "indexer", ratio, config.index_head_dim))
    return segments


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
        self.segments = pool_segments(model_config)
        self.sizing = KVPoolSizing.of(model_config, block_size_tokens=config.block_size_tokens,
                                      num_primary_blocks=config.num_primary_blocks,
                                      num_cpu_blocks=config.num_cpu_blocks, kv_storage=config.kv_storage,
                                      activation_bytes=torch.empty((), dtype=dtype).element_size())
        pin = self.device.type == "cuda"
        self.primary: dict[tuple[int, str], torch.Tensor] = {}
        self.cpu: dict[tuple[int, str], torch.Tensor] = {}
        element_dtypes = {Element.FP8_BYTE: torch.uint8, Element.ACTIVATION: dtype, Element.FLOAT32: torch.float32}
        for segment in self.sizing.segments:
            tier_dtype = element_dtypes[segment.element]
            self.primary[segment.key] = torch.zeros(config.num_primary_blocks, segment.num_rows, segment.width,
                                                    dtype=tier_dtype, device=self.device)  # [blocks, rows, Ws]
            self.cpu[segment.key] = torch.zeros(config.num_cpu_blocks, segment.num_rows, segment.width,
                                                dtype=tier_dtype, pin_memory=pin)
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
        """Bytes of one block in each tier: its rows and its boundary snapshot, as stored."""
        return sum(t.shape[1:].numel() * t.element_size() for t in self.primary.values())

    def num_row_bytes_per_block(self) -> int:
        """Bytes of one block's compressed and indexer rows alone (what grows with the context), as stored."""
        return sum(self.primary[(s.layer, s.which)].shape[1:].numel() * self.primary[(s.layer, s.which)].element_size()
                   for s in self.segments)

    def _check(self, pairs: Sequence[tuple[int, int]], source_blocks: int, target_blocks: int, what: str) -> None:
        for source, target in pairs:
            if not (0 <= source < source_blocks and 0 <= target < target_blocks):
                raise KVPoolError(f"{what} ({source}, {target}) is outside the tiers "
                                  f"({source_blocks}, {target_blocks} blocks)")

    def move(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """swap_out (primary, cpu) pairs, then swap_in (cpu, primary) pairs; ordered as the module says."""
        if not swap_out and not swap_in:
            return
        self._check(swap_out, self.config.num_primary_blocks, self.config.num_cpu_blocks, "swap_out")
        self._check(swap_in, self.config.num_cpu_blocks, self.config.num_primary_blocks, "swap_in")
        if self._copy_stream is None:
            self._copy(swap_out, swap_in, non_blocking=False)
        else:
            compute = torch.cuda.current_stream(self.device)
            self._copy_stream.wait_stream(compute)  # = an event recorded on compute, waited on the side
            with torch.cuda.stream(self._copy_stream):
                self._copy(swap_out, swap_in, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            compute.wait_event(done)
        self.num_blocks_swapped_out += len(swap_out)
        self.num_blocks_swapped_in += len(swap_in)
        log.debug("attention.kv_moved", num_swapped_out=len(swap_out), num_swapped_in=len(swap_in))

    def _copy(self, swap_out, swap_in, non_blocking: bool) -> None:
        for key, primary in self.primary.items():
            cpu = self.cpu[key]
            for primary_block, cpu_block in swap_out:
                cpu[cpu_block].copy_(primary[primary_block], non_blocking=non_blocking)
            for cpu_block, primary_block in swap_in:
                primary[primary_block].copy_(cpu[cpu_block], non_blocking=non_blocking)
