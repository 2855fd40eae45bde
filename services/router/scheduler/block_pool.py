"""One tier of KV blocks (or of resume snapshots), and the pool of per-sequence state slots. Integers only.

A block is free, in use (reference count >= 1), or cached: free with a prefix key still
attached, so a later request with the same prefix can take it back without recomputing.
Allocation takes never-keyed free blocks first, then evicts cached blocks least recently
freed first (LRU). Invariant: every block id is in exactly one of
{free_uncached, evictable (refcount 0 and keyed), in use (refcount >= 1)}.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable


class BlockPool:
    """Blocks 0..num_blocks-1 of one tier with reference counts and an optional prefix cache."""

    def __init__(self, num_blocks: int, *, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._free_uncached: deque[int] = deque(range(num_blocks))
        # Free blocks that still carry a key, oldest-freed first (eviction order).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}

    # -- counts -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (never-keyed free plus evictable cached)."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks carrying a key, in use or not."""
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_hashes[block_id]

    # -- allocation -------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks blocks with reference count 1; the caller checked num_free_blocks."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"allocate({num_blocks}) with {self.num_free_blocks} free blocks")
        block_ids = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block_id = self._free_uncached.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                del self._hash_to_block[self._block_hashes[block_id]]
                self._block_hashes[block_id] = None
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int], *, keep_cached: bool = True) -> None:
        """Drop one reference from each block. Pass a request's blocks tail first so its
        last blocks are evicted before its first ones (the first are shared more often).
        keep_cached=False: a block whose last reference this drops loses its key (it goes
        back to the never-keyed free blocks instead of waiting for eviction)."""
        for block_id in block_ids:
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            self._ref_counts[block_id] = count
            if count == 0:
                block_hash = self._block_hashes[block_id]
                if block_hash is not None and not keep_cached:
                    del self._hash_to_block[block_hash]
                    self._block_hashes[block_id] = block_hash = None
                if block_hash is None:
                    self._free_uncached.append(block_id)
                else:
                    self._evictable[block_id] = None

    # -- prefix cache -----------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this key, in use or cached, or None."""
        return self._hash_to_block.get(block_hash)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def take_cached(self, block_id: int) -> None:
        """Add a reference to a keyed block found by lookup (revives it if it was free)."""
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Attach a key to an in-use block. False (and nothing changes) when caching is off,
        the block already has a key, or another block already holds this key."""
        if not self.enable_caching or self._block_hashes[block_id] is not None:
            return False
        if block_hash in self._hash_to_block:
            return False
        self._block_hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True


class StateSlotPool:
    """Fixed-size per-sequence state slots (window ring + open compressor state) on the
    attention worker; one per running sequence, so their number bounds running sequences."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free_slots: deque[int] = deque(range(num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free state slot")
        return self._free_slots.popleft()

    def free(self, slot: int) -> None:
        self._free_slots.append(slot)
