"""A placement: which expert worker holds which (layer, expert), as data and as a TOML file.

Every (layer, expert) has exactly one *primary* holder and any number of *replicas* on other
workers; replicas share that expert's tokens. One worker entry per expert worker (one device):

    format_version = 1
    num_layers = 43
    num_experts = 256
    bytes_per_expert = 13369344
    policy = "balanced"

    [[workers]]
    name = "expert-cuda0"
    device = "cuda:0"
    expected_token_share = 0.8123

    [workers.experts]          # layer = compact expert ranges (primary copies)
    0 = "0-17,20,31-40"

    [workers.replicas]         # extra copies of experts whose primary is elsewhere
    0 = "3,5"

Reading uses the standard library's `tomllib`; writing is a small dedicated writer (the standard
library has none; strings quoted by `common.security.cli_args.toml_string`, as the deployment writer does), so the file stays free of third-party dependencies.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from moemesh.common.security.cli_args import toml_string

FORMAT_VERSION = 1
ExpertId = tuple[int, int]  # (layer, expert)


class PlacementError(ValueError):
    """A placement that is malformed or does not cover the model; the message names what is wrong."""


@dataclass(frozen=True)
class WorkerPlacement:
    """One expert worker: its device and the (layer, expert) pairs it holds, sorted."""

    name: str
    device: str
    expert_ids: tuple[ExpertId, ...]
    replica_ids: tuple[ExpertId, ...] = ()
    expected_token_share: float | None = None  # informational, written by the planner

    @property
    def held_ids(self) -> tuple[ExpertId, ...]:
        return tuple(sorted(self.expert_ids + self.replica_ids))

    @property
    def num_held(self) -> int:
        return len(self.expert_ids) + len(self.replica_ids)


@dataclass(frozen=True)
class Placement:
    num_layers: int
    num_experts: int
    bytes_per_expert: int
    workers: tuple[WorkerPlacement, ...]
    policy: str | None = None
    stats_source: str | None = None
    extra: dict = field(default_factory=dict, compare=False)  # unknown top-level keys, kept on round trip

    def holders(self) -> dict[ExpertId, list[str]]:
        """(layer, expert) -> worker names, primary first."""
        holders: dict[ExpertId, list[str]] = {}
        for worker in self.workers:
            for expert_id in worker.expert_ids:
                holders.setdefault(expert_id, []).insert(0, worker.name)
        for worker in self.workers:
            for expert_id in worker.replica_ids:
                holders.setdefault(expert_id, []).append(worker.name)
        return holders

    def worker(self, name: str) -> WorkerPlacement:
        for worker in self.workers:
            if worker.name == name:
                return worker
        raise PlacementError(f"no worker named {name!r} (workers: {', '.join(w.name for w in self.workers)})")

    def worker_bytes(self, name: str) -> int:
        return self.worker(name).num_held * self.bytes_per_expert


# ---------------------------------------------------------------------------------- ranges
def format_ranges(values: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    ordered = sorted(set(values))
    parts: list[str] = []
    index = 0
    while index < len(ordered):
        end = index
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        parts.append(str(ordered[index]) if end == index else f"{ordered[index]}-{ordered[end]}")
        index = end + 1
    return ",".join(parts)


def parse_ranges(text: str, where: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; duplicates and reversed ranges are errors."""
    values: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            start, stop = int(first), int(last if sep else first)
        except ValueError:
            raise PlacementError(f"{where}: {part!r} is not N or N-M") from None
        if start < 0 or stop < start:
            raise PlacementError(f"{where}: range {part!r} is empty or negative")
        values.extend(range(start, stop + 1))
    if len(values) != len(set(values)):
        raise PlacementError(f"{where}: {text!r} lists an expert twice")
    return values


def group_by_layer(expert_ids: Iterable[ExpertId]) -> dict[int, list[int]]:
    by_layer: dict[int, list[int]] = {}
    for layer, expert in expert_ids:
        by_layer.setdefault(layer, []).append(expert)
    return dict(sorted(by_layer.items()))


# ---------------------------------------------------------------------------------- TOML
def format_toml(placement: Placement) -> str:
    lines = [
        "# moemesh expert placement: one [[workers]] entry per expert worker.",
        "# [workers.experts] holds primary copies, [workers.replicas] extra copies (layer = expert ranges).",
        f"format_version = {FORMAT_VERSION}",
        f"num_layers = {placement.num_layers}",
        f"num_experts = {placement.num_experts}",
        f"bytes_per_expert = {placement.bytes_per_expert}",
    ]
    if placement.policy is not None:
        lines.append(f"policy = {toml_string(placement.policy)}")
    if placement.stats_source is not None:
        lines.append(f"stats = {toml_string(placement.stats_source)}")
    for worker in placement.workers:
        lines += ["", "[[workers]]", f"name = {toml_string(worker.name)}", f"device = {toml_string(worker.device)}"]
        if worker.expected_token_share is not None:
            lines.append(f"expected_token_share = {worker.expected_token_share:.6f}")
        for table, ids in (("experts", worker.expert_ids), ("replicas", worker.replica_ids)):
            lines += ["", f"[workers.{table}]"]
            lines += [f"{layer} = {toml_string(format_ranges(experts))}" for layer, experts in group_by_layer(ids).items()]
    return "\n".join(lines) + "\n"


def parse_toml(text: str, source: str = "<text>") -> Placement:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise PlacementError(f"{source}: not valid TOML: {error}") from None
    version = data.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise PlacementError(f"{source}: format_version={version!r}, this moemesh reads {FORMAT_VERSION}")
    try:
        num_layers = _positive_int(data.pop("num_layers"), "num_layers", source)
        num_experts = _positive_int(data.pop("num_experts"), "num_experts", source)
        bytes_per_expert = _positive_int(data.pop("bytes_per_expert"), "bytes_per_expert", source)
    except KeyError as missing:
        raise PlacementError(f"{source}: missing key {missing.args[0]}") from None
    policy, stats_source = data.pop("policy", None), data.pop("stats", None)
    workers = []
    for index, entry in enumerate(data.pop("workers", [])):
        where = f"{source}: workers[{index}]"
        if not isinstance(entry.get("name"), str) or not isinstance(entry.get("device"), str):
            raise PlacementError(f"{where}: needs string keys name and device")
        share = entry.get("expected_token_share")
        workers.append(WorkerPlacement(
            name=entry["name"],
            device=entry["device"],
            expert_ids=_parse_layer_table(entry.get("experts", {}), f"{where} ({entry['name']}) experts"),
            replica_ids=_parse_layer_table(entry.get("replicas", {}), f"{where} ({entry['name']}) replicas"),
            expected_token_share=None if share is None else float(share),
        ))
    return Placement(num_layers, num_experts, bytes_per_expert, tuple(workers), policy, stats_source, extra=data)


def write_placement(path: str | Path, placement: Placement) -> None:
    Path(path).write_text(format_toml(placement), encoding="utf-8")


def read_placement(path: str | Path) -> Placement:
    path = Path(path)
    return parse_toml(path.read_text(encoding="utf-8"), str(path))


def _parse_layer_table(table: dict, where: str) -> tuple[ExpertId, ...]:
    if not isinstance(table, dict):
        raise PlacementError(f"{where}: must be a table of layer = \"ranges\"")
    ids: list[ExpertId] = []
    for key, ranges in table.items():
        if not key.isdigit() or not isinstance(ranges, str):
            raise PlacementError(f"{where}: entry {key!r} = {ranges!r} is not layer = \"ranges\"")
        ids.extend((int(key), expert) for expert in parse_ranges(ranges, f"{where} layer {key}"))
    return tuple(sorted(ids))


def _positive_int(value, key: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlacementError(f"{source}: {key}={value!r} must be a positive integer")
    return value


# ---------------------------------------------------------------------------------- validation
def placement_problems(placement: Placement, num_layers: int, num_experts: int,
                       bytes_per_expert: int | None = None) -> list[str]:
    """Every way `placement` fails to serve a model of this shape (empty list: valid)."""
    problems: list[str] = []
    if (placement.num_layers, placement.num_experts) != (num_layers, num_experts):
        problems.append(f"placement is for {placement.num_layers} layers x {placement.num_experts} experts, "
                        f"the model has {num_layers} x {num_experts}")
    if bytes_per_expert is not None and placement.bytes_per_expert != bytes_per_expert:
        problems.append(f"bytes_per_expert={placement.bytes_per_expert}, the model's experts take {bytes_per_expert}")
    names = [worker.name for worker in placement.workers]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"worker name {name!r} is used twice")
    primary_of: dict[ExpertId, str] = {}
    held: set[ExpertId] = set()
    for worker in placement.workers:
        for expert_id in worker.expert_ids + worker.replica_ids:
            layer, expert = expert_id
            if not (0 <= layer < num_layers and 0 <= expert < num_experts):
                problems.append(f"worker {worker.name}: (layer {layer}, expert {expert}) is outside the model")
        for expert_id in set(worker.expert_ids) & set(worker.replica_ids):
            problems.append(f"worker {worker.name}: {_name(expert_id)} is both primary and replica")
        for expert_id in worker.expert_ids:
            if expert_id in primary_of:
                problems.append(f"{_name(expert_id)} is primary on both {primary_of[expert_id]} and {worker.name}; "
                                "mark one as a replica")
            primary_of.setdefault(expert_id, worker.name)
        held.update(worker.expert_ids + worker.replica_ids)
    orphans = sorted(held - set(primary_of))
    if orphans:
        problems.append("replicas without a primary copy: " + _describe(orphans))
    missing = [(layer, expert) for layer in range(num_layers) for expert in range(num_experts)
               if (layer, expert) not in held]
    if missing:
        problems.append(f"{len(missing)} (layer, expert) pairs are held by no worker: " + _describe(missing))
    return problems


def validate_placement(placement: Placement, num_layers: int, num_experts: int,
                       bytes_per_expert: int | None = None) -> None:
    """Raise PlacementError listing every problem (see placement_problems)."""
    problems = placement_problems(placement, num_layers, num_experts, bytes_per_expert)
    if problems:
        raise PlacementError("invalid placement:\n  " + "\n  ".join(problems))


def validate_for_config(placement: Placement, config) -> None:
    """Validate against a `common.model.config.ModelConfig` (layers, experts, bytes per expert)."""
    from moemesh.common.placement.cost import ModelCosts

    costs = ModelCosts.from_config(config)
    validate_placement(placement, costs.num_layers, costs.num_experts, costs.bytes_per_expert)


def _name(expert_id: ExpertId) -> str:
    return f"(layer {expert_id[0]}, expert {expert_id[1]})"


def _describe(expert_ids: list[ExpertId], max_layers: int = 8) -> str:
    """'layer 3: 7,9-12; layer 5: 0-255; ... (and 4 more layers)'."""
    by_layer = group_by_layer(expert_ids)
    shown = [f"layer {layer}: {format_ranges(experts)}" for layer, experts in list(by_layer.items())[:max_layers]]
    more = len(by_layer) - max_layers
    return "; ".join(shown) + (f" (and {more} more layers)" if more > 0 else "")
