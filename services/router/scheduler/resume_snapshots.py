"""Which resume snapshots each request holds, and which the prefix cache keeps. Integers only.

A sequence resumes at a block end b = (k+1)·B (a prefix-cache hit, a swap-in) from its first
k+1 blocks plus a resume snapshot taken at b: the window rows and pending compressor inputs
there, a fixed size whatever the context (the attention worker's snapshot tier,
services/attention/boundary.py). Snapshots are a pool of their own, far smaller than the blocks,
so a context token costs only its rows. The router hands them out:

- Targets: each step, for the block ends its tokens cross, a request gets a snapshot for the last
  one (where it resumes after a preemption) and, with the prefix cache on, for those the cache
  keeps (below). The worker records only those; other block ends get nothing.
- Held: a request holds the snapshot of its last confirmed block end (k_conf = confirmed // B - 1)
  and those of its step in flight. After a step (`settle`) the snapshot at k_conf is keyed with the
  block's chain hash (so another request with the same prefix can resume from it at once) and
  older ones are dropped: kept in the cache (evictable, least recently freed first) or forgotten.
- Kept: the last block end before a prompt's last token (where the same prompt again resumes),
  every `snapshot_interval_blocks`-th block end, and a divergence point: when a request's cached
  blocks match deeper than the deepest cached snapshot (another request shared its first blocks and
  then went its own way: a shared system prompt), the last matching block end, so the next request
  with that prefix resumes there. A request's last snapshot stays cached when it finishes, so a
  conversation's next turn resumes where the previous one ended.
- Swaps: a swap-out copies the k_conf snapshot to the CPU snapshot tier; a swap-in brings it back
  to a fresh GPU snapshot.
- Short of free snapshots (the pool is sized by `[kv] num_primary_snapshots`), a block end goes
  without one: the prefix cache then resumes from an earlier block end, and a preemption
  recomputes instead of swapping.

A prefix hit resumes at the deepest cached block whose end has a cached snapshot.
Legend: B tokens per block, k block index (its end is (k+1)·B).
"""

from __future__ import annotations

from moemesh.services.router.scheduler.block_pool import BlockPool


class ResumeSnapshots:
    def __init__(self, num_gpu_snapshots: int, num_cpu_snapshots: int, *, block_size_tokens: int,
                 enable_caching: bool, snapshot_interval_blocks: int) -> None:
        self.block_size_tokens = block_size_tokens
        self.enable_caching = enable_caching
        self.snapshot_interval_blocks = snapshot_interval_blocks
        self.gpu = BlockPool(num_gpu_snapshots, enable_caching=enable_caching)
        self.cpu = BlockPool(num_cpu_snapshots, enable_caching=False)
        self._held: dict[str, dict[int, int]] = {}  # request -> block index -> GPU snapshot
        self._swapped: dict[str, tuple[int, int]] = {}  # request -> (block index, CPU snapshot)
        self._divergence: dict[str, int] = {}  # request -> the block index of its divergence point

    # -- reads ------------------------------------------------------------------------
    def held(self, request_id: str) -> dict[int, int]:
        return dict(self._held.get(request_id, {}))

    def holds_anything(self, request_id: str) -> bool:
        return request_id in self._held or request_id in self._swapped or request_id in self._divergence

    def cached(self, block_hash: bytes) -> int | None:
        """The GPU snapshot keyed with this block's chain hash, or None."""
        return self.gpu.lookup(block_hash)

    def keeps(self, request_id: str, block_index: int, num_prompt_tokens: int) -> bool:
        """Whether the prefix cache keeps the snapshot at this block's end once its request moves on."""
        if not self.enable_caching:
            return False
        return (block_index == (num_prompt_tokens - 1) // self.block_size_tokens - 1
                or (block_index + 1) % self.snapshot_interval_blocks == 0
                or self._divergence.get(request_id) == block_index)

    def keep_divergence(self, request_id: str, block_index: int) -> None:
        """Keep the snapshot at this block's end (the request's cached blocks matched this deep, the cached
        snapshots less)."""
        if self.enable_caching:
            self._divergence[request_id] = block_index

    # -- per step -----------------------------------------------------------------------
    def targets(self, request_id: str, first_position: int, end_position: int,
                num_prompt_tokens: int) -> tuple[tuple[int, int], ...]:
        """(block index, GPU snapshot) pairs for the block ends in (first_position, end_position] that a step over
        those positions records: the last one, and those the cache keeps. Allocates what the request does not
        hold yet; a block end finds no free snapshot -> it gets none."""
        size = self.block_size_tokens
        first_index, last_index = first_position // size, end_position // size - 1
        if last_index < first_index:
            return ()
        wanted = [index for index in range(first_index, last_index)
                  if self.keeps(request_id, index, num_prompt_tokens)]
        held = self._held.setdefault(request_id, {})
        pairs = []
        for index in (*wanted, last_index):
            if index not in held:
                if self.gpu.num_free_blocks == 0:
                    continue
                held[index] = self.gpu.allocate(1)[0]
            pairs.append((index, held[index]))
        return tuple(pairs)

    def settle(self, request_id: str, num_confirmed_tokens: int, block_hashes: list[bytes],
               num_prompt_tokens: int) -> None:
        """Between steps: key the snapshot of the last confirmed block end with its block's hash, drop the older
        ones (kept cached or forgotten, module docstring) and those past the confirmed tokens (rejected drafts)."""
        held = self._held.get(request_id)
        if not held:
            return
        confirmed_index = num_confirmed_tokens // self.block_size_tokens - 1
        for index in sorted(held):
            if index == confirmed_index:
                if self.enable_caching and index < len(block_hashes):
                    self.gpu.register(held[index], block_hashes[index])
                continue
            snapshot = held.pop(index)
            keep = index < confirmed_index and self.keeps(request_id, index, num_prompt_tokens)
            if keep and index < len(block_hashes):
                self.gpu.register(snapshot, block_hashes[index])
            self.gpu.free((snapshot,), keep_cached=keep)

    # -- admission ----------------------------------------------------------------------
    def take_cached(self, request_id: str, block_index: int, snapshot: int) -> None:
        """A prefix hit resumes from this cached snapshot (a reference is taken)."""
        self.gpu.take_cached(snapshot)
        self._held.setdefault(request_id, {})[block_index] = snapshot

    # -- preemption ---------------------------------------------------------------------
    def can_swap_out(self, request_id: str, block_index: int) -> bool:
        return block_index in self._held.get(request_id, {}) and self.cpu.num_free_blocks > 0

    def swap_out(self, request_id: str, block_index: int) -> tuple[int, int]:
        """Copy the snapshot at block_index's end to the CPU tier and let go of every GPU snapshot the request
        holds -> (GPU snapshot, CPU snapshot)."""
        gpu_snapshot = self._held[request_id][block_index]
        cpu_snapshot = self.cpu.allocate(1)[0]
        self._swapped[request_id] = (block_index, cpu_snapshot)
        self.release(request_id)
        return gpu_snapshot, cpu_snapshot

    def can_swap_in(self) -> bool:
        return self.gpu.num_free_blocks > 0

    def swap_in(self, request_id: str) -> tuple[int, int]:
        """Bring a swapped request's snapshot back -> (CPU snapshot, GPU snapshot)."""
        block_index, cpu_snapshot = self._swapped.pop(request_id)
        gpu_snapshot = self.gpu.allocate(1)[0]
        self.cpu.free((cpu_snapshot,))
        self._held[request_id] = {block_index: gpu_snapshot}
        return cpu_snapshot, gpu_snapshot

    # -- release ------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Let go of everything the request holds on the GPU: keyed snapshots stay cached, the rest is free."""
        for snapshot in self._held.pop(request_id, {}).values():
            self.gpu.free((snapshot,))

    def release_all(self, request_id: str) -> None:
        """Release, and free the CPU snapshot of a swapped request."""
        self.release(request_id)
        self._divergence.pop(request_id, None)
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            self.cpu.free((swapped[1],))
