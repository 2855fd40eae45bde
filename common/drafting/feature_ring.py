"""Per-request ring of the last `max_positions` (128) fused target features (docs/speculation.md §3.3 step 1).

The drafter's attention sees, besides its own block, one context entry per past position: the
fused feature `main_x` [D] of the target's hidden states after the `dspark_target_layer_ids`
layers. Features are fused (`main_proj` + `main_norm`) once, when they arrive, so a ring holds
D floats per position instead of L·D and a draft step does not re-fuse the same rows every step.

Invariants of one ring:
- positions strictly increase from oldest to newest; at most `max_positions` + `spare_positions` entries
  stored (older ones are overwritten), the newest `max_positions` read (the drafter's window is
  `sliding_window` = 128 positions);
- appending rows that start at position p first drops every entry at a position >= p: such
  entries belong to tokens that verification rejected, or are being resent (rollback is implicit in
  the next append). A drafter in the attention worker's process is given a verify step's rows before
  verification decides, so its ring may end in rejected drafts' rows until the next append or the
  truncation to the seed position that precedes every draft; what a draft reads is always the
  request's committed prefix;
- `truncate(n)` keeps positions < n (explicit rollback to an accepted length of n tokens).
Gaps (positions never sent, e.g. a prefix restored from cache) are allowed: the drafter just
has fewer context entries. Legend: C context positions, D hidden.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class FeatureRing:
    """One request's context ring on one device. It stores up to max_positions + spare_positions entries and
    shows the newest max_positions: rows appended past the committed prefix (at most spare_positions of them,
    a verify step's drafts given before verification decides) never push out a committed entry the drafter
    still reads."""

    def __init__(self, max_positions: int, hidden_size: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", spare_positions: int = 0) -> None:
        if max_positions < 1 or spare_positions < 0:
            raise ValueError(f"max_positions={max_positions} must be >= 1, spare_positions={spare_positions} >= 0")
        self.max_positions = max_positions
        self.capacity = max_positions + spare_positions
        self._features = torch.zeros(self.capacity, hidden_size, dtype=dtype, device=device)  # [cap, D]
        self._positions = torch.zeros(self.capacity, dtype=torch.long)  # [cap], host: read every step
        self._oldest = 0  # index of the oldest entry
        self.num_positions = 0  # entries stored (up to capacity)

    def _slot(self, age: int) -> int:
        return (self._oldest + age) % self.capacity

    @property
    def next_position(self) -> int | None:
        """One past the newest position held (None when empty)."""
        if self.num_positions == 0:
            return None
        return int(self._positions[self._slot(self.num_positions - 1)]) + 1

    def truncate(self, num_positions: int) -> None:
        """Keep only entries at positions < num_positions (newest entries go first)."""
        while self.num_positions and int(self._positions[self._slot(self.num_positions - 1)]) >= num_positions:
            self.num_positions -= 1
        if self.num_positions == 0:
            self._oldest = 0

    def append(self, start_position: int, features: torch.Tensor) -> None:
        """features [n, D] for positions start_position ..< start_position + n (already fused). The rows land
        in at most two slices of the ring (one copy each, no index tensor to move to the device)."""
        if start_position < 0:
            raise ValueError(f"start_position={start_position} must be >= 0")
        self.truncate(start_position)
        num_rows = features.shape[0]
        skip = max(0, num_rows - self.capacity)  # only the newest capacity rows can survive
        rows = features[skip:]  # [n', D]
        first = start_position + skip
        count = rows.shape[0]
        overflow = max(0, self.num_positions + count - self.capacity)  # oldest entries overwritten
        start_slot = self._slot(self.num_positions)  # where the first new row goes
        if overflow:
            self._oldest = (self._oldest + overflow) % self.capacity
            self.num_positions -= overflow
        head = min(count, self.capacity - start_slot)  # rows before the ring's end, the rest wraps to 0
        self._features[start_slot: start_slot + head].copy_(rows[:head])
        self._positions[start_slot: start_slot + head] = torch.arange(first, first + head)
        if count > head:
            self._features[: count - head].copy_(rows[head:])
            self._positions[: count - head] = torch.arange(first + head, first + count)
        self.num_positions += count

    def context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(main_x [C, D], positions [C] int64) of the newest C = min(num_positions, max_positions) entries, oldest
        first. At most two slices joined (no index tensor to move to the device)."""
        count = min(self.num_positions, self.max_positions)
        begin = self._slot(self.num_positions - count)
        end = begin + count
        if end <= self.capacity:
            return self._features[begin: end], self._positions[begin: end]
        wrapped = end - self.capacity
        return (torch.cat([self._features[begin:], self._features[:wrapped]]),
                torch.cat([self._positions[begin:], self._positions[:wrapped]]))


class FeatureRings:
    """Every live request's ring; requests never see each other's entries."""

    def __init__(self, max_positions: int, hidden_size: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", spare_positions: int = 0) -> None:
        self.max_positions = max_positions
        self.spare_positions = spare_positions
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._rings: dict[str, FeatureRing] = {}

    def __len__(self) -> int:
        return len(self._rings)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rings

    def __iter__(self) -> Iterator[str]:
        return iter(self._rings)

    def ring(self, request_id: str) -> FeatureRing:
        """The request's ring, created empty on first use."""
        ring = self._rings.get(request_id)
        if ring is None:
            ring = FeatureRing(self.max_positions, self.hidden_size, dtype=self.dtype, device=self.device,
                               spare_positions=self.spare_positions)
            self._rings[request_id] = ring
        return ring

    def append(self, request_id: str, start_position: int, features: torch.Tensor) -> None:
        self.ring(request_id).append(start_position, features)

    def truncate(self, request_id: str, num_positions: int) -> None:
        if request_id in self._rings:
            self._rings[request_id].truncate(num_positions)

    def drop(self, request_id: str) -> None:
        """Forget a finished or aborted request (unknown ids are ignored)."""
        self._rings.pop(request_id, None)
