"""The expert placement planner: (layer, expert) -> devices, within per-device memory budgets.

Policies (see `cost.py` for the time model both are judged by):
- `hottest`: sort every (layer, expert) by its share of its layer's activations, fill the fastest
  device first up to its budget, the rest to the next fastest, and so on.
- `balanced`: per layer, minimise the slowest branch (max over devices of expected time; the
  attention device also carries attention + shared expert). A greedy pass places experts from the
  hottest down where they raise their layer's slowest branch least, then moves and swaps experts
  off each layer's slowest device while that strictly lowers the layer's sorted branch times. The
  same local search also runs from the `hottest` plan and the better result is kept, so balanced is
  never worse than hottest on the objective. It may leave budget unused where that is faster.
`num_replicated_hot = N` then gives the N hottest experts of every layer a second copy on another
device where budget remains (hottest: fastest device with room; balanced: only where it lowers the
layer's branch times, followed by another local-search pass around the copies).
Without statistics every share is equal and the plan is uniform across layers.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from moemesh.common.placement.cost import CostConfig, CostModel, Evaluation, ModelCosts, Shares, evaluate
from moemesh.common.placement.devices import DeviceSpec, format_bytes
from moemesh.common.placement.placement_file import Placement, WorkerPlacement

_EPS = 1e-15
_MOVE_CANDIDATES = 32  # heaviest experts of the slowest device tried per local-search step
_SWAP_CANDIDATES = 12  # heaviest on the slowest x lightest on each other device


class Policy(enum.Enum):
    HOTTEST = "hottest"
    BALANCED = "balanced"


class PlacementInfeasible(ValueError):
    """The budgets cannot hold every (layer, expert) once; the message names devices and shortfall."""


@dataclass(frozen=True)
class PlanConfig:
    policy: Policy = Policy.BALANCED
    num_replicated_hot: int = 0
    cost: CostConfig = field(default_factory=CostConfig)
    max_refine_rounds: int = 6

    def __post_init__(self) -> None:
        if self.num_replicated_hot < 0:
            raise ValueError(f"num_replicated_hot={self.num_replicated_hot} must be >= 0")


@dataclass(frozen=True)
class DeviceSummary:
    """What one device got: primary experts, replicas, bytes, share of routed tokens, mean layer time."""

    device: str
    worker_name: str
    budget_bytes: int
    num_experts: int
    num_replicas: int
    num_bytes: int
    token_share: float
    mean_layer_s: float
    throughput_assumed: bool


@dataclass(frozen=True)
class PlanResult:
    placement: Placement
    devices: tuple[DeviceSpec, ...]
    evaluation: Evaluation
    summaries: tuple[DeviceSummary, ...]


def worker_name(device: str) -> str:
    """'cuda:0' -> 'expert-cuda0' (one expert worker per device)."""
    return "expert-" + device.replace(":", "")


def uniform_shares(num_layers: int, num_experts: int) -> list[list[float]]:
    return [[1.0 / num_experts] * num_experts for _ in range(num_layers)]


def expert_capacities(costs: ModelCosts, devices: Sequence[DeviceSpec]) -> list[int]:
    return [device.budget_bytes // costs.bytes_per_expert for device in devices]


def check_feasible(costs: ModelCosts, devices: Sequence[DeviceSpec]) -> None:
    """Raise PlacementInfeasible unless the budgets hold every (layer, expert) at least once."""
    capacities = expert_capacities(costs, devices)
    needed = costs.num_layers * costs.num_experts
    if sum(capacities) >= needed:
        return
    short = needed - sum(capacities)
    per_device = ", ".join(
        f"{d.name} {format_bytes(d.budget_bytes)} -> {n} experts" for d, n in zip(devices, capacities)
    )
    raise PlacementInfeasible(
        f"placement does not fit: {costs.num_layers} layers x {costs.num_experts} experts = {needed} experts "
        f"x {format_bytes(costs.bytes_per_expert)} = {format_bytes(needed * costs.bytes_per_expert)}, but the "
        f"budgets hold {sum(capacities)} ({per_device}); short by {short} experts "
        f"({format_bytes(short * costs.bytes_per_expert)}). Raise a --budget or add a device."
    )


def plan_placement(
    costs: ModelCosts,
    devices: Sequence[DeviceSpec],
    shares: Shares | None,
    config: PlanConfig,
    stats_source: str | None = None,
) -> PlanResult:
    """Plan a placement; `shares[l][e]` from RoutingStats.shares(), or None for a uniform plan."""
    devices = tuple(devices)
    names = [device.name for device in devices]
    if len(set(names)) != len(names):
        raise ValueError(f"devices listed twice: {names}")
    check_feasible(costs, devices)
    if shares is None:
        shares = uniform_shares(costs.num_layers, costs.num_experts)
    model = CostModel(costs, devices, shares, config.cost)
    # Hottest first; ties by expert then layer so an even plan spreads every layer alike.
    order = sorted(
        ((layer, expert) for layer in range(costs.num_layers) for expert in range(costs.num_experts)),
        key=lambda item: (-shares[item[0]][item[1]], item[1], item[0]),
    )
    if config.policy is Policy.HOTTEST:
        state = _PlanState(model, expert_capacities(costs, devices))
        _fill_hottest(state, order)
        _replicate(state, order, config.num_replicated_hot, shares, only_if_faster=False)
    else:
        candidates = []
        for start in (_fill_balanced, _fill_hottest):
            state = _PlanState(model, expert_capacities(costs, devices))
            start(state, order)
            _refine(state, config.max_refine_rounds)
            candidates.append(state)
        state = min(candidates, key=lambda s: s.objective_s())
        if config.num_replicated_hot:
            _replicate(state, order, config.num_replicated_hot, shares, only_if_faster=True)
            _refine(state, config.max_refine_rounds)  # rebalance the single-copy experts around the replicas
    evaluation = evaluate(model, state.holders)
    placement = _to_placement(state, costs, config.policy, stats_source, evaluation)
    summaries = tuple(
        DeviceSummary(
            device=device.name,
            worker_name=worker_name(device.name),
            budget_bytes=device.budget_bytes,
            num_experts=state.num_primary[index],
            num_replicas=state.num_held[index] - state.num_primary[index],
            num_bytes=state.num_held[index] * costs.bytes_per_expert,
            token_share=evaluation.token_shares[index],
            mean_layer_s=evaluation.mean_layer_s(index),
            throughput_assumed=device.throughput_assumed,
        )
        for index, device in enumerate(devices)
    )
    return PlanResult(placement, devices, evaluation, summaries)


class _PlanState:
    """holders[l][e] = device indices (primary first), the per-layer loads, remaining capacity."""

    def __init__(self, model: CostModel, capacities: list[int]) -> None:
        costs = model.costs
        self.model = model
        self.remaining = list(capacities)
        self.holders: list[list[list[int]]] = [[[] for _ in range(costs.num_experts)] for _ in range(costs.num_layers)]
        self.loads = [model.new_layer(layer) for layer in range(costs.num_layers)]
        self.rank_s = [model.device_rank_s(index) for index in range(len(model.devices))]
        self.num_held = [0] * len(model.devices)
        self.num_primary = [0] * len(model.devices)

    def place(self, layer: int, expert: int, device_index: int) -> None:
        """Add a holder (the first one is the primary); re-weights the existing holders."""
        holders = self.holders[layer][expert]
        load = self.loads[layer]
        for held_on in holders:
            load.remove(held_on, expert, len(holders))
        holders.append(device_index)
        for held_on in holders:
            load.add(held_on, expert, len(holders))
        self.remaining[device_index] -= 1
        self.num_held[device_index] += 1
        if len(holders) == 1:
            self.num_primary[device_index] += 1

    def move(self, layer: int, expert: int, to_index: int) -> None:
        """Move a single-holder expert to another device."""
        (from_index,) = self.holders[layer][expert]
        load = self.loads[layer]
        load.remove(from_index, expert, 1)
        load.add(to_index, expert, 1)
        self.holders[layer][expert] = [to_index]
        for index, delta in ((from_index, 1), (to_index, -1)):
            self.remaining[index] += delta
            self.num_held[index] -= delta
            self.num_primary[index] -= delta

    def layer_key(self, layer: int) -> tuple[float, ...]:
        """Branch times sorted slowest first; compared lexicographically (a strict order for search)."""
        return tuple(sorted(self.loads[layer].times(), reverse=True))

    def objective_s(self) -> float:
        return sum(load.max_s() for load in self.loads)


def _fill_hottest(state: _PlanState, order: list[tuple[int, int]]) -> None:
    device_order = sorted(range(len(state.remaining)), key=lambda index: (state.rank_s[index], index))
    cursor = 0
    for layer, expert in order:
        while state.remaining[device_order[cursor]] <= 0:
            cursor += 1  # check_feasible guarantees a device with room remains
        state.place(layer, expert, device_order[cursor])


def _fill_balanced(state: _PlanState, order: list[tuple[int, int]]) -> None:
    """Greedy: each expert, hottest first, where its layer's slowest branch grows least."""
    for layer, expert in order:
        load = state.loads[layer]
        loaded = state.model.select_prob[layer][expert] > 0
        best_key, best_index = None, None
        for index in range(len(state.remaining)):
            if state.remaining[index] <= 0:
                continue
            load.add(index, expert, 1)
            times = load.times()
            load.remove(index, expert, 1)
            # Unloaded experts go to the slowest device with room, keeping fast memory for replicas.
            rank = state.rank_s[index] if loaded else -state.rank_s[index]
            key = (max(times), times[index], rank)
            if best_key is None or key < best_key:
                best_key, best_index = key, index
        state.place(layer, expert, best_index)


def _refine(state: _PlanState, max_rounds: int) -> None:
    """Local search per layer: move or swap experts off the slowest device while that strictly
    lowers the layer's sorted branch times. Moves need room on the target device; swaps do not."""
    for _ in range(max_rounds):
        improved = False
        for layer in range(len(state.loads)):
            while _improve_layer(state, layer):
                improved = True
        if not improved:
            return


def _improve_layer(state: _PlanState, layer: int) -> bool:
    load = state.loads[layer]
    times = load.times()
    slowest = max(range(len(times)), key=lambda index: times[index])
    current = state.layer_key(layer)
    select = state.model.select_prob[layer]
    on_slowest = sorted(
        (e for e, held in enumerate(state.holders[layer]) if held == [slowest] and select[e] > 0),
        key=lambda e: -select[e],
    )
    best: tuple[tuple[float, ...], tuple] | None = None
    for expert in on_slowest[:_MOVE_CANDIDATES]:
        for target in range(len(times)):
            if target == slowest or state.remaining[target] <= 0:
                continue
            load.remove(slowest, expert, 1)
            load.add(target, expert, 1)
            key = tuple(sorted(load.times(), reverse=True))
            load.remove(target, expert, 1)
            load.add(slowest, expert, 1)
            if key < current and (best is None or key < best[0]):
                best = (key, ("move", expert, target))
    if best is None:
        for target in range(len(times)):
            if target == slowest:
                continue
            lightest = sorted((e for e, held in enumerate(state.holders[layer]) if held == [target]),
                              key=lambda e: select[e])[:_SWAP_CANDIDATES]
            for heavy in on_slowest[:_SWAP_CANDIDATES]:
                for light in lightest:
                    if select[light] >= select[heavy]:
                        break
                    _swap_loads(load, slowest, heavy, target, light)
                    key = tuple(sorted(load.times(), reverse=True))
                    _swap_loads(load, target, heavy, slowest, light)
                    if key < current and (best is None or key < best[0]):
                        best = (key, ("swap", heavy, target, light))
    if best is None:
        return False
    action = best[1]
    if action[0] == "move":
        state.move(layer, action[1], action[2])
    else:
        _, heavy, target, light = action
        state.move(layer, heavy, target)  # capacity is restored by the second move
        state.move(layer, light, slowest)
    return True


def _swap_loads(load, from_index: int, heavy: int, to_index: int, light: int) -> None:
    """Exchange `heavy` (on from_index) and `light` (on to_index) in the running sums only."""
    load.remove(from_index, heavy, 1)
    load.add(to_index, heavy, 1)
    load.remove(to_index, light, 1)
    load.add(from_index, light, 1)


def _replicate(state: _PlanState, order: list[tuple[int, int]], num_hot: int, shares: Shares,
               only_if_faster: bool) -> None:
    """Second copies of the `num_hot` hottest experts per layer, hottest overall first."""
    if num_hot == 0:
        return
    hot = set()
    for layer, row in enumerate(shares):
        ranked = sorted(range(len(row)), key=lambda e: (-row[e], e))
        hot.update((layer, e) for e in ranked[:num_hot] if row[e] > 0)
    for layer, expert in order:
        if (layer, expert) not in hot:
            continue
        holders = state.holders[layer][expert]
        candidates = [i for i in range(len(state.remaining)) if i not in holders and state.remaining[i] > 0]
        if not candidates:
            continue
        if not only_if_faster:
            state.place(layer, expert, min(candidates, key=lambda i: (state.rank_s[i], i)))
            continue
        current = state.layer_key(layer)
        best_key, best_index = None, None
        for index in candidates:
            state.place(layer, expert, index)
            key = state.layer_key(layer)
            _unplace_last(state, layer, expert)
            if key < current and (best_key is None or key < best_key):
                best_key, best_index = key, index
        if best_index is not None:
            state.place(layer, expert, best_index)


def _unplace_last(state: _PlanState, layer: int, expert: int) -> None:
    """Undo the latest `place` of (layer, expert) (used to try a replica)."""
    holders = state.holders[layer][expert]
    load = state.loads[layer]
    for held_on in holders:
        load.remove(held_on, expert, len(holders))
    device_index = holders.pop()
    for held_on in holders:
        load.add(held_on, expert, len(holders))
    state.remaining[device_index] += 1
    state.num_held[device_index] -= 1


def _to_placement(state: _PlanState, costs: ModelCosts, policy: Policy, stats_source: str | None,
                  evaluation: Evaluation) -> Placement:
    primaries: list[list[tuple[int, int]]] = [[] for _ in state.model.devices]
    replicas: list[list[tuple[int, int]]] = [[] for _ in state.model.devices]
    for layer, row in enumerate(state.holders):
        for expert, holders in enumerate(row):
            primaries[holders[0]].append((layer, expert))
            for index in holders[1:]:
                replicas[index].append((layer, expert))
    workers = tuple(
        WorkerPlacement(worker_name(device.name), device.name, tuple(primaries[i]), tuple(replicas[i]),
                        round(evaluation.token_shares[i], 6))
        for i, device in enumerate(state.model.devices)
        if primaries[i] or replicas[i]
    )
    return Placement(costs.num_layers, costs.num_experts, costs.bytes_per_expert, workers, policy.value, stats_source)
