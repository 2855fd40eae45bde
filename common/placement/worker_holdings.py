"""Which expert worker the attention worker sends each (layer, expert) to, and what a worker loads.

Placements are the files of `common.placement.placement_file` (TOML, primary copies and
replicas per worker). A deployment's `[[expert]] placement` is "all", "none" (a worker that
joins empty and gets its experts from `moemesh placement apply`) or such a file. This module
adds what the data path needs:
- `WorkerHoldings`: per worker (deployment order) its primary and replica pairs;
- `owner_table`: (layer, expert) -> the first worker (in deployment order) holding it as a
  primary copy, else the first holding a replica. The attention worker dispatches by every
  pair's full list of holders (`placement_switch.pair_holders`), so replicas share the load
  (services/attention/replica_routing.py); this table is the single-copy view;
- `round_robin` / `contiguous`: simple placements for `generate --distributed` and tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moemesh.common.placement.placement_file import Placement, PlacementError, WorkerPlacement, read_placement

Pair = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class WorkerHoldings:
    name: str
    primary: tuple[Pair, ...]
    replicas: tuple[Pair, ...] = ()

    @property
    def held(self) -> tuple[Pair, ...]:
        return tuple(sorted(set(self.primary) | set(self.replicas)))


def all_pairs(num_layers: int, num_experts: int) -> tuple[Pair, ...]:
    return tuple((layer, expert) for layer in range(num_layers) for expert in range(num_experts))


def holdings_for(name: str, placement_spec: str, num_layers: int, num_experts: int) -> WorkerHoldings:
    """From a deployment `placement` key: "all", "none" or a placement file naming this worker."""
    if placement_spec == "all":
        return WorkerHoldings(name, all_pairs(num_layers, num_experts))
    if placement_spec == "none":
        return WorkerHoldings(name, ())
    placement = read_placement(placement_spec)
    if (placement.num_layers, placement.num_experts) != (num_layers, num_experts):
        raise PlacementError(f"{placement_spec}: placement is for {placement.num_layers} x {placement.num_experts}, "
                             f"the model has {num_layers} x {num_experts}")
    worker = placement.worker(name)
    return WorkerHoldings(name, worker.expert_ids, worker.replica_ids)


def owner_table(workers: Sequence[WorkerHoldings], num_layers: int, num_experts: int) -> list[list[int]]:
    """owner[layer][expert] -> index into workers; PlacementError when a pair is held by nobody."""
    owner: list[list[int | None]] = [[None] * num_experts for _ in range(num_layers)]
    for copies in ("primary", "replicas"):
        for index, worker in enumerate(workers):
            for layer, expert in getattr(worker, copies):
                if not (0 <= layer < num_layers and 0 <= expert < num_experts):
                    raise PlacementError(f"{worker.name}: pair ({layer}, {expert}) is outside the model")
                if owner[layer][expert] is None:
                    owner[layer][expert] = index
    missing = [(l, e) for l in range(num_layers) for e in range(num_experts) if owner[l][e] is None]
    if missing:
        raise PlacementError(f"{len(missing)} (layer, expert) pairs are held by no worker, first {missing[0]}")
    return owner  # type: ignore[return-value]


def _placement(names: Sequence[str], devices: Sequence[str], pairs: list[list[Pair]], num_layers: int,
               num_experts: int, bytes_per_expert: int, policy: str) -> Placement:
    workers = tuple(WorkerPlacement(name=n, device=d, expert_ids=tuple(sorted(p)))
                    for n, d, p in zip(names, devices, pairs))
    return Placement(num_layers, num_experts, bytes_per_expert, workers, policy)


def round_robin(names: Sequence[str], devices: Sequence[str], num_layers: int, num_experts: int,
                bytes_per_expert: int) -> Placement:
    """Expert e of every layer on worker e mod N."""
    n = len(names)
    pairs = [[(l, e) for l, e in all_pairs(num_layers, num_experts) if e % n == i] for i in range(n)]
    return _placement(names, devices, pairs, num_layers, num_experts, bytes_per_expert, "round_robin")


def contiguous(names: Sequence[str], devices: Sequence[str], num_layers: int, num_experts: int,
               bytes_per_expert: int) -> Placement:
    """Worker i holds expert ids [i·E/N, (i+1)·E/N) of every layer."""
    n = len(names)
    bounds = [i * num_experts // n for i in range(n + 1)]
    pairs = [[(l, e) for l in range(num_layers) for e in range(bounds[i], bounds[i + 1])] for i in range(n)]
    return _placement(names, devices, pairs, num_layers, num_experts, bytes_per_expert, "contiguous")
