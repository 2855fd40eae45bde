"""Which expert worker computes each (token, top-k slot) of an MoE layer, for the dispatcher (moe_dispatch.py).

A `ReplicaRouter` (replica_routing.py) holds every (layer, expert) pair's holders and which workers are down.
Layers where no expert has two live copies index a precomputed owner table: `owner_host` [L, E] on the host
(the CUDA IPC split works on host ids) and `owner` [L, E] on the attention device, uploaded again only when
the router's version changes. Layers with a choice count the tokens per expert and let the router pick a copy
per expert, least outstanding work first or in turn. Derived views (`LayerHolders`, the number of workers the
router names) are kept per router and version: walking every holder list costs ~0.5 ms at V4-Flash size.
Legend: T tokens, K top-k slots, L layers, E routed experts, R tables.
"""

from __future__ import annotations

import torch

from moemesh.services.attention.layer_holders import LayerHolders
from moemesh.services.attention.replica_routing import ReplicaPolicy, ReplicaRouter


class SlotOwners:
    def __init__(self, owner_table: list[list[int]], replica_policy: ReplicaPolicy, device: torch.device) -> None:
        self.device = device
        self.replica_policy = ReplicaPolicy(replica_policy)
        self._holders: LayerHolders | None = None  # of the current router and version
        self._counted: tuple[ReplicaRouter, int] | None = None  # the router and version num_workers is of
        self._num_workers = 0
        self.set_router(ReplicaRouter([[(owner,) for owner in row] for row in owner_table], self.replica_policy))

    def set_router(self, router: ReplicaRouter) -> None:
        """Replace the routing table (between steps only: nothing may be in flight)."""
        self.router = router
        self._uploaded_version: int | None = None
        self.refresh()

    def set_holders(self, holders: list[list[tuple[int, ...]]]) -> None:
        """holders [L][E] -> worker indices (primary first); workers marked down stay down."""
        router = ReplicaRouter(holders, self.replica_policy)
        for worker in sorted(self.router.down):
            router.mark_down(worker)
        self.set_router(router)

    def set_owner_tables(self, owner_tables: list[list[list[int]]]) -> None:
        """R >= 1 tables [L, E] (table r: the r-th copy of each pair), as `replica_owner_tables` builds."""
        self.set_holders(ReplicaRouter.from_owner_tables(owner_tables).holders)

    @property
    def owners(self) -> torch.Tensor:
        """[R, L, E] live holders taken in turn (for display and tests; dispatch uses the router)."""
        return torch.tensor(self.router.round_robin_tables(), dtype=torch.long)

    @property
    def version_key(self) -> tuple[ReplicaRouter, int]:
        """What a table derived from the routing is valid for (the router and its version)."""
        return self.router, self.router.version

    def refresh(self) -> None:
        """`owner_host` [L, E] and `owner` [L, E] on the device, of the router's current version."""
        if self._uploaded_version != self.router.version:
            self.owner_host = torch.tensor(self.router.base, dtype=torch.long)  # [L, E]
            self.owner = self.owner_host.to(self.device)  # [L, E]
            self._uploaded_version = self.router.version

    def num_workers(self) -> int:
        """How many workers the router names (read once per router and version)."""
        if self._counted != self.version_key:
            self._counted, self._num_workers = self.version_key, self.router.num_workers
        return self._num_workers

    def layer_holders(self) -> LayerHolders:
        if self._holders is None or not self._holders.current(self.router):
            self._holders = LayerHolders.of(self.router)
        return self._holders

    def of_slots(self, layer: int, ids: torch.Tensor, in_flight: list[int]) -> tuple[torch.Tensor, dict[int, int]]:
        """ids [T, K] int64 -> (owner [T, K] worker index, on the device of ids; {worker: expert-slot tokens}
        of the workers that get any, ascending). in_flight: expert-slot tokens each worker has outstanding
        (the least-loaded replica choice). Host ids (the CUDA IPC split): host work only; device ids
        (ZeroMQ): one read-back of the counts."""
        self.refresh()
        if not self.router.has_choice(layer):
            owner = (self.owner_host if ids.device.type == "cpu" else self.owner)[layer][ids]  # [T, K]
            per_worker = torch.bincount(owner.reshape(-1), minlength=len(in_flight)).tolist()
            return owner, {w: n for w, n in enumerate(per_worker) if n}
        row, per_worker = self._choose_replicas(layer, ids, in_flight)
        return torch.tensor(row, dtype=torch.long, device=ids.device)[ids], per_worker

    def _choose_replicas(self, layer: int, ids: torch.Tensor, in_flight: list[int]) -> tuple[list[int], dict[int, int]]:
        """A layer with replicas: (row [E] worker index per expert, chosen for this batch; {worker: expert-slot
        tokens} of the workers that get any, ascending). One read-back of the per-expert counts."""
        counts = torch.bincount(ids.reshape(-1), minlength=self.router.num_experts).tolist()  # [E]
        row = self.router.choose(layer, counts, in_flight)  # [E]
        per_worker: dict[int, int] = {}
        for expert, count in enumerate(counts):
            if count:
                per_worker[row[expert]] = per_worker.get(row[expert], 0) + count
        return row, dict(sorted(per_worker.items()))
