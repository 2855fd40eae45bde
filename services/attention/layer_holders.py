"""Who computes each layer's routed experts under one routing table, worked out once per table and version.

The dispatcher asks per layer (on the hot path) which workers hold it, whether it has replicas and whether
one worker holds all of it; walking the table for that costs ~0.5 ms at V4-Flash size (43 x 256), so
`LayerHolders.of(router)` builds the answers once and the dispatcher keeps them until the router or its
version changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.services.attention.replica_routing import ReplicaRouter


@dataclass(frozen=True)
class LayerHolders:
    """holders[layer]: the distinct primary holders, ascending; choice[layer]: the layer has replicas."""

    router: ReplicaRouter
    version: int
    holders: tuple[tuple[int, ...], ...]
    choice: tuple[bool, ...]

    @classmethod
    def of(cls, router: ReplicaRouter) -> LayerHolders:
        return cls(router, router.version, tuple(tuple(sorted(set(row))) for row in router.base),
                   tuple(router.has_choice(layer) for layer in range(len(router.base))))

    def current(self, router: ReplicaRouter) -> bool:
        return self.router is router and self.version == router.version

    def sole(self, layer: int) -> int | None:
        """The one worker holding every expert of `layer` (None: several)."""
        row = self.holders[layer]
        return row[0] if len(row) == 1 else None

    def all_held_by(self, worker_index: int | None) -> bool:
        """Every layer held by `worker_index` alone, without replicas."""
        return worker_index is not None and all(
            not choice and row == (worker_index,) for row, choice in zip(self.holders, self.choice))

    def owned_pairs(self, worker_index: int) -> list[tuple[int, int]]:
        """The (layer, expert) pairs `worker_index` computes, on layers without replicas."""
        return [(layer, expert) for layer, row in enumerate(self.router.base) if not self.choice[layer]
                for expert, owner in enumerate(row) if owner == worker_index]
