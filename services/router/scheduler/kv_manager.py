"""KV bookkeeping of every request: GPU block tables, CPU (swapped) block tables, resume
snapshots, state slots.

The router decides and the attention worker executes: this class only moves integers, and
the scheduler turns its answers into the step plan (block tables, snapshot targets, swap pairs,
restores).

What a block holds (worker side): for its tokens, the compressed rows and indexer rows. To
resume at a block's end a sequence also needs a resume snapshot taken there (window rows,
compressor state; `resume_snapshots.py` says which block ends get one). A sequence can not
resume inside a block: swapping and prefix restores always land on block ends with a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.services.router.scheduler.block_pool import BlockPool, StateSlotPool
from moemesh.services.router.scheduler.config import SchedulerConfig, num_blocks_for_tokens
from moemesh.services.router.scheduler.prefix_cache import extend_block_hashes
from moemesh.services.router.scheduler.request import Request
from moemesh.services.router.scheduler.resume_snapshots import ResumeSnapshots


@dataclass(frozen=True)
class CachedPrefix:
    """The longest cached prefix a request can resume from: its GPU blocks and the cached resume snapshot at the
    last one's end (None with no blocks); num_matched_blocks: how many of its first blocks are cached at all."""

    block_ids: tuple[int, ...] = ()
    snapshot_id: int | None = None
    num_matched_blocks: int = 0


@dataclass(frozen=True)
class TierMove:
    """What a swap copies between the tiers: (source, target) block pairs and the (source, target) snapshot pair
    (swap-out: GPU -> CPU; swap-in: CPU -> GPU)."""

    block_pairs: list[tuple[int, int]]
    snapshot_pair: tuple[int, int]


@dataclass
class PrefixCacheCounters:
    """Cumulative prefix-cache figures for metrics (tokens, not blocks)."""

    num_queries: int = 0  # admissions that looked the cache up
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


class KVBlockManager:
    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size_tokens = config.block_size_tokens
        self.gpu = BlockPool(config.num_gpu_blocks, enable_caching=config.enable_prefix_caching)
        self.cpu = BlockPool(config.num_cpu_blocks, enable_caching=False)
        self.slots = StateSlotPool(config.max_num_running_seqs)
        self.snapshots = ResumeSnapshots(config.num_gpu_snapshots, config.num_cpu_snapshots,
                                         block_size_tokens=config.block_size_tokens,
                                         enable_caching=config.enable_prefix_caching,
                                         snapshot_interval_blocks=config.snapshot_interval_blocks)
        self.prefix_counters = PrefixCacheCounters()
        self._gpu_tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}
        self._slots: dict[str, int] = {}
        # Leading blocks of a GPU table already offered to the prefix cache.
        self._num_registered: dict[str, int] = {}

    # -- reads ------------------------------------------------------------------------
    def gpu_block_ids(self, request_id: str) -> list[int]:
        return self._gpu_tables.get(request_id, [])

    def cpu_block_ids(self, request_id: str) -> list[int]:
        return self._cpu_tables.get(request_id, [])

    def state_slot(self, request_id: str) -> int | None:
        return self._slots.get(request_id)

    def num_new_blocks(self, request_id: str, num_total_tokens: int) -> int:
        """Blocks to add so the GPU table covers num_total_tokens tokens."""
        needed = num_blocks_for_tokens(num_total_tokens, self.block_size_tokens)
        return max(0, needed - len(self._gpu_tables.get(request_id, ())))

    # -- admission (waiting -> running) -----------------------------------------------
    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest cached prefix of the request's confirmed tokens whose last block end has a cached resume
        snapshot. Capped below num_tokens: at least one token must be computed so the step produces logits."""
        if not self.gpu.enable_caching:
            return CachedPrefix()
        extend_block_hashes(
            request.block_hashes,
            _ConfirmedTokens(request),
            request.num_tokens,
            self.block_size_tokens,
        )
        max_hit_blocks = (request.num_tokens - 1) // self.block_size_tokens
        hit_block_ids: list[int] = []
        num_resumable, snapshot_id = 0, None  # the deepest hit block whose end has a cached snapshot
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = self.gpu.lookup(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
            cached = self.snapshots.cached(block_hash)
            if cached is not None:
                num_resumable, snapshot_id = len(hit_block_ids), cached
        return CachedPrefix(tuple(hit_block_ids[:num_resumable]), snapshot_id, len(hit_block_ids))

    def can_admit(self, prefix: CachedPrefix, num_total_tokens: int) -> bool:
        """Whether a slot and the blocks for num_total_tokens (cached ones reused) are free."""
        if self.slots.num_free_slots == 0:
            return False
        num_new = num_blocks_for_tokens(num_total_tokens, self.block_size_tokens) - len(prefix.block_ids)
        # Reviving a cached block that is free takes it out of the free count.
        num_revived = sum(1 for block_id in prefix.block_ids if self.gpu.is_evictable(block_id))
        return max(0, num_new) + num_revived <= self.gpu.num_free_blocks

    def admit(self, request: Request, prefix: CachedPrefix, num_total_tokens: int) -> int:
        """Take the cached blocks and snapshot, allocate the rest and a state slot; return the slot."""
        cached_block_ids = prefix.block_ids
        self.prefix_counters.num_queries += 1
        self.prefix_counters.num_queried_tokens += request.num_tokens
        self.prefix_counters.num_hit_tokens += len(cached_block_ids) * self.block_size_tokens
        for block_id in cached_block_ids:
            self.gpu.take_cached(block_id)
        if cached_block_ids:
            self.snapshots.take_cached(request.request_id, len(cached_block_ids) - 1, prefix.snapshot_id)
        if prefix.num_matched_blocks > len(cached_block_ids):
            self.snapshots.keep_divergence(request.request_id, prefix.num_matched_blocks - 1)
        table = list(cached_block_ids)
        num_new = num_blocks_for_tokens(num_total_tokens, self.block_size_tokens) - len(table)
        table.extend(self.gpu.allocate(max(0, num_new)))
        self._gpu_tables[request.request_id] = table
        self._num_registered[request.request_id] = len(cached_block_ids)
        slot = self.slots.allocate()
        self._slots[request.request_id] = slot
        return slot

    # -- growth and shrinking of a running sequence ------------------------------------
    def grow(self, request_id: str, num_total_tokens: int) -> bool:
        """Extend the GPU table to cover num_total_tokens; False (nothing taken) if short."""
        num_new = self.num_new_blocks(request_id, num_total_tokens)
        if num_new > self.gpu.num_free_blocks:
            return False
        if num_new:
            self._gpu_tables[request_id].extend(self.gpu.allocate(num_new))
        return True

    def trim(self, request_id: str, num_kept_tokens: int) -> None:
        """Free the table's blocks past num_kept_tokens (e.g. blocks of rejected drafts)."""
        table = self._gpu_tables[request_id]
        num_kept = num_blocks_for_tokens(num_kept_tokens, self.block_size_tokens)
        if len(table) > num_kept:
            self.gpu.free(reversed(table[num_kept:]))
            del table[num_kept:]

    def snapshot_targets(self, request: Request, first_position: int, end_position: int) -> tuple[tuple[int, int], ...]:
        """The resume snapshots a step of the request over [first_position, end_position) records
        (`ResumeSnapshots.targets`)."""
        return self.snapshots.targets(request.request_id, first_position, end_position, request.num_prompt_tokens)

    def settle(self, request: Request) -> None:
        """After a step (num_computed_tokens counts confirmed tokens only): key its full blocks and its last
        snapshot for the prefix cache, drop older snapshots."""
        self.cache_full_blocks(request)
        self.snapshots.settle(request.request_id, request.num_computed_tokens, request.block_hashes,
                              request.num_prompt_tokens)

    def cache_full_blocks(self, request: Request) -> None:
        """Key the request's full computed blocks so later requests can share them. Only
        called between steps, when num_computed_tokens counts confirmed tokens only."""
        request_id = request.request_id
        num_full = request.num_computed_tokens // self.block_size_tokens
        if not self.gpu.enable_caching or num_full <= self._num_registered[request_id]:
            return  # no block filled since the last call (the common decode step)
        extend_block_hashes(
            request.block_hashes,
            _ConfirmedTokens(request),
            request.num_computed_tokens,
            self.block_size_tokens,
        )
        table = self._gpu_tables[request_id]
        num_full = min(len(table), num_full)
        for block_index in range(self._num_registered[request_id], num_full):
            self.gpu.register(table[block_index], request.block_hashes[block_index])
        self._num_registered[request_id] = max(self._num_registered[request_id], num_full)

    # -- preemption -------------------------------------------------------------------
    def can_swap_out(self, request_id: str, num_full_blocks: int) -> bool:
        """Room in the CPU tier, and a snapshot at the last full block's end to resume from."""
        return (0 < num_full_blocks <= self.cpu.num_free_blocks
                and self.snapshots.can_swap_out(request_id, num_full_blocks - 1))

    def swap_out(self, request_id: str, num_full_blocks: int) -> TierMove:
        """Copy the first num_full_blocks blocks and the snapshot at their end to the CPU tier, free the GPU
        table, its snapshots and the slot. The worker must copy them before the step writes into any GPU
        block or snapshot (a freed one may be reused in the same step)."""
        table = self._gpu_tables.pop(request_id)
        cpu_table = self.cpu.allocate(num_full_blocks)
        pairs = list(zip(table[:num_full_blocks], cpu_table))
        snapshot_pair = self.snapshots.swap_out(request_id, num_full_blocks - 1)
        self.gpu.free(reversed(table))
        self._cpu_tables[request_id] = cpu_table
        self._num_registered.pop(request_id)
        self.slots.free(self._slots.pop(request_id))
        return TierMove(pairs, snapshot_pair)

    def can_swap_in(self, request_id: str, num_total_tokens: int) -> bool:
        if self.slots.num_free_slots == 0 or not self.snapshots.can_swap_in():
            return False
        num_blocks = max(
            len(self._cpu_tables[request_id]),
            num_blocks_for_tokens(num_total_tokens, self.block_size_tokens),
        )
        return num_blocks <= self.gpu.num_free_blocks

    def swap_in(self, request_id: str, num_total_tokens: int) -> tuple[TierMove, int]:
        """Bring a swapped request's blocks and snapshot back and give it a slot and room for
        num_total_tokens. Returns (what to copy CPU -> GPU, slot)."""
        cpu_table = self._cpu_tables.pop(request_id)
        table = self.gpu.allocate(len(cpu_table))
        pairs = list(zip(cpu_table, table))
        snapshot_pair = self.snapshots.swap_in(request_id)
        self.cpu.free(reversed(cpu_table))
        self._gpu_tables[request_id] = table
        self._num_registered[request_id] = 0
        slot = self.slots.allocate()
        self._slots[request_id] = slot
        if not self.grow(request_id, num_total_tokens):
            raise RuntimeError("swap_in without room; call can_swap_in first")
        return TierMove(pairs, snapshot_pair), slot

    # -- release ----------------------------------------------------------------------
    def free_request(self, request_id: str) -> None:
        """Give back everything the request holds in any tier (finish, abort, recompute)."""
        table = self._gpu_tables.pop(request_id, None)
        if table is not None:
            self.gpu.free(reversed(table))
        cpu_table = self._cpu_tables.pop(request_id, None)
        if cpu_table is not None:
            self.cpu.free(reversed(cpu_table))
        self._num_registered.pop(request_id, None)
        self.snapshots.release_all(request_id)
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.slots.free(slot)

    def holds_anything(self, request_id: str) -> bool:
        return (
            request_id in self._gpu_tables
            or request_id in self._cpu_tables
            or request_id in self._slots
            or self.snapshots.holds_anything(request_id)
        )


class _ConfirmedTokens:
    """Slice view over a request's prompt + output ids without concatenating them."""

    __slots__ = ("_request",)

    def __init__(self, request: Request) -> None:
        self._request = request

    def __getitem__(self, span: slice) -> list[int]:
        return self._request.token_ids_between(span.start, span.stop)
