"""Routing statistics: how often each (layer, expert) was selected, split by phase.

The attention worker counts, per MoE layer, how many token-slots the gate sent to each routed
expert (a token with top-k = 6 adds 6 activations per layer). Prefill and decode are counted
apart because they stress experts differently (prefill is compute-bound and batch-wide, decode
is latency-bound); counts whose phase is unknown (files written by Lucebox) are kept as
`Phase.UNSPLIT`. The planner usually sums all phases.

File format (Lucebox's hotness table, so its files read here and ours read there): two `#` header
lines, then one row per layer with one comma-separated count per expert (expert 0..E-1):

    # hotness table: n_layer=43 n_expert=256 n_expert_used=6 phase=decode
    # format: one row per layer, columns are expert activation counts (expert 0..N-1)
    12,0,7,...

Lucebox reads the first header line with a fixed prefix and ignores what follows, so the extra
`phase=` key is safe. `write_stats_files` writes the all-phase total to the given path and each
phase to a sibling (`x.csv` -> `x.prefill.csv`, `x.decode.csv`), every file a valid hotness table.
"""

from __future__ import annotations

import enum
import math
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

_HEADER_PREFIX = "# hotness table:"
_FORMAT_LINE = "# format: one row per layer, columns are expert activation counts (expert 0..N-1)"
_KEY_VALUE = re.compile(r"(\w+)=(\S+)")


class StatsError(ValueError):
    """A routing-statistics file or update that cannot be used; the message says where and why."""


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    UNSPLIT = "all"  # phase unknown (Lucebox files) or the sum of all phases (our total file)


ALL_PHASES: tuple[Phase, ...] = (Phase.PREFILL, Phase.DECODE, Phase.UNSPLIT)


@dataclass(frozen=True)
class LayerSkew:
    """How unevenly one layer's activations spread over its experts.

    max_over_mean: hottest expert's count / mean count (1.0 = uniform; E = everything on one).
    top8_share: fraction of activations that went to the 8 hottest experts.
    effective_experts: exp(entropy) of the count distribution (E = uniform, 1 = one expert).
    num_unused: experts that were never selected.
    All are None-free: an empty layer reports the uniform values (1.0, 8/E, E, 0).
    """

    layer: int
    num_activations: int
    max_over_mean: float
    top8_share: float
    effective_experts: float
    num_unused: int


class RoutingStats:
    """Activation counts [phase][layer][expert] (plain ints; safe to merge and to write).

    Invariant: every table has `num_layers` rows of `num_experts` non-negative ints. This is a
    mutable accumulator (the attention worker adds to it every step), not a config.
    """

    def __init__(self, num_layers: int, num_experts: int, num_experts_per_tok: int | None = None) -> None:
        if num_layers < 1 or num_experts < 1:
            raise StatsError(f"num_layers={num_layers} and num_experts={num_experts} must be positive")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self._counts: dict[Phase, list[list[int]]] = {
            phase: [[0] * num_experts for _ in range(num_layers)] for phase in ALL_PHASES
        }

    # ------------------------------------------------------------------ counting
    def add_counts(self, phase: Phase, layer: int, counts_per_expert: Sequence[int]) -> None:
        """Add one layer's per-expert counts (e.g. a bincount of this step's top-k ids)."""
        self._check_layer(layer)
        if len(counts_per_expert) != self.num_experts:
            raise StatsError(f"layer {layer}: got {len(counts_per_expert)} counts, expected {self.num_experts}")
        row = self._counts[phase][layer]
        for expert, count in enumerate(counts_per_expert):
            count = int(count)
            if count < 0:
                raise StatsError(f"layer {layer} expert {expert}: negative count {count}")
            row[expert] += count

    def observe(self, phase: Phase, layer: int, expert_ids: Iterable[int]) -> None:
        """Count each selected expert id once (slow path for small batches and tests)."""
        self._check_layer(layer)
        row = self._counts[phase][layer]
        for expert in expert_ids:
            expert = int(expert)
            if not 0 <= expert < self.num_experts:
                raise StatsError(f"layer {layer}: expert id {expert} outside 0..{self.num_experts - 1}")
            row[expert] += 1

    # ------------------------------------------------------------------ queries
    def layer_counts(self, layer: int, phases: Iterable[Phase] = ALL_PHASES) -> list[int]:
        self._check_layer(layer)
        total = [0] * self.num_experts
        for phase in phases:
            for expert, count in enumerate(self._counts[phase][layer]):
                total[expert] += count
        return total

    def counts(self, phases: Iterable[Phase] = ALL_PHASES) -> list[list[int]]:
        """[layer][expert] summed over `phases` (a fresh copy)."""
        phases = tuple(phases)
        return [self.layer_counts(layer, phases) for layer in range(self.num_layers)]

    def num_activations(self, phases: Iterable[Phase] = ALL_PHASES) -> int:
        phases = tuple(phases)
        return sum(sum(row) for phase in phases for row in self._counts[phase])

    def has_phase(self, phase: Phase) -> bool:
        return any(any(row) for row in self._counts[phase])

    def shares(self, phases: Iterable[Phase] = ALL_PHASES) -> list[list[float]]:
        """[layer][expert] fraction of the layer's activations; a layer with no counts is uniform."""
        shares: list[list[float]] = []
        for row in self.counts(phases):
            total = sum(row)
            shares.append([count / total for count in row] if total else [1.0 / self.num_experts] * len(row))
        return shares

    def skew(self, layer: int, phases: Iterable[Phase] = ALL_PHASES) -> LayerSkew:
        return layer_skew(layer, self.layer_counts(layer, phases))

    def skews(self, phases: Iterable[Phase] = ALL_PHASES) -> list[LayerSkew]:
        phases = tuple(phases)
        return [self.skew(layer, phases) for layer in range(self.num_layers)]

    # ------------------------------------------------------------------ combining
    def merge(self, other: "RoutingStats") -> "RoutingStats":
        """A new RoutingStats with both counts added phase by phase; shapes must agree."""
        if (self.num_layers, self.num_experts) != (other.num_layers, other.num_experts):
            raise StatsError(
                f"cannot merge stats of {self.num_layers}x{self.num_experts} with "
                f"{other.num_layers}x{other.num_experts} (layers x experts)"
            )
        top_k = self.num_experts_per_tok
        if top_k is None or (other.num_experts_per_tok is not None and other.num_experts_per_tok != top_k):
            top_k = other.num_experts_per_tok if top_k is None else None
        merged = RoutingStats(self.num_layers, self.num_experts, top_k)
        for source in (self, other):
            for phase in ALL_PHASES:
                for layer in range(self.num_layers):
                    merged.add_counts(phase, layer, source._counts[phase][layer])
        return merged

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise StatsError(f"layer {layer} outside 0..{self.num_layers - 1}")


def layer_skew(layer: int, counts: Sequence[int]) -> LayerSkew:
    """Skew measures of one layer's per-expert counts (see LayerSkew)."""
    num_experts = len(counts)
    total = sum(counts)
    if total == 0:
        return LayerSkew(layer, 0, 1.0, min(8, num_experts) / num_experts, float(num_experts), 0)
    mean = total / num_experts
    entropy = -sum((c / total) * math.log(c / total) for c in counts if c)
    top8 = sum(sorted(counts, reverse=True)[:8])
    return LayerSkew(
        layer=layer,
        num_activations=total,
        max_over_mean=max(counts) / mean,
        top8_share=top8 / total,
        effective_experts=math.exp(entropy),
        num_unused=sum(1 for c in counts if c == 0),
    )


# ---------------------------------------------------------------------------------- CSV files
def format_csv(stats: RoutingStats, phase: Phase) -> str:
    """One hotness table; `Phase.UNSPLIT` means the sum of every phase."""
    phases = ALL_PHASES if phase is Phase.UNSPLIT else (phase,)
    top_k = stats.num_experts_per_tok
    header = f"{_HEADER_PREFIX} n_layer={stats.num_layers} n_expert={stats.num_experts}"
    if top_k is not None:
        header += f" n_expert_used={top_k}"
    lines = [f"{header} phase={phase.value}", _FORMAT_LINE]
    lines += [",".join(str(count) for count in row) for row in stats.counts(phases)]
    return "\n".join(lines) + "\n"


def write_csv(path: str | Path, stats: RoutingStats, phase: Phase = Phase.UNSPLIT) -> None:
    """Write one hotness table atomically (a reader never sees half a file)."""
    _write_atomic(Path(path), format_csv(stats, phase))


def phase_path(path: str | Path, phase: Phase) -> Path:
    """`stats.csv` -> `stats.prefill.csv` / `stats.decode.csv`; UNSPLIT is the path itself."""
    path = Path(path)
    if phase is Phase.UNSPLIT:
        return path
    suffix = path.suffix or ".csv"
    return path.with_name(f"{path.stem if path.suffix else path.name}.{phase.value}{suffix}")


def write_stats_files(path: str | Path, stats: RoutingStats) -> list[Path]:
    """The all-phase total at `path` plus one file per measured phase; returns the paths written."""
    written = [Path(path)]
    write_csv(path, stats, Phase.UNSPLIT)
    for phase in (Phase.PREFILL, Phase.DECODE):
        if stats.has_phase(phase):
            target = phase_path(path, phase)
            write_csv(target, stats, phase)
            written.append(target)
    return written


def parse_csv(text: str, source: str = "<text>") -> RoutingStats:
    """Read a hotness table (ours or Lucebox's). Counts land in the phase the header names;
    no `phase=` key (Lucebox) or `phase=all` gives `Phase.UNSPLIT`."""
    header: dict[str, str] = {}
    rows: list[list[int]] = []
    for line_number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if "n_layer=" in line:
                header.update(_KEY_VALUE.findall(line))
            continue
        row: list[int] = []
        for field in line.rstrip(",").split(","):  # a trailing comma is tolerated
            field = field.strip()
            if not field.isdigit():
                raise StatsError(f"{source}:{line_number}: {field!r} is not a non-negative integer count")
            row.append(int(field))
        if rows and len(row) != len(rows[0]):
            raise StatsError(f"{source}:{line_number}: {len(row)} counts, earlier rows have {len(rows[0])}")
        rows.append(row)
    if not rows:
        raise StatsError(f"{source}: no count rows")
    num_layers = _header_int(header, "n_layer", source, default=len(rows))
    num_experts = _header_int(header, "n_expert", source, default=len(rows[0]))
    top_k = _header_int(header, "n_expert_used", source, default=None)
    if num_layers != len(rows):
        raise StatsError(f"{source}: header says n_layer={num_layers} but the file has {len(rows)} rows")
    if num_experts != len(rows[0]):
        raise StatsError(f"{source}: header says n_expert={num_experts} but rows have {len(rows[0])} counts")
    phase_name = header.get("phase", Phase.UNSPLIT.value)
    try:
        phase = Phase(phase_name)
    except ValueError:
        raise StatsError(f"{source}: phase={phase_name!r} is not one of prefill, decode, all") from None
    stats = RoutingStats(num_layers, num_experts, top_k)
    for layer, row in enumerate(rows):
        stats.add_counts(phase, layer, row)
    return stats


def read_csv(path: str | Path) -> RoutingStats:
    path = Path(path)
    return parse_csv(path.read_text(encoding="utf-8"), str(path))


def read_stats_files(paths: Iterable[str | Path]) -> RoutingStats:
    """Read and merge several hotness tables (e.g. one per phase, or several runs)."""
    merged: RoutingStats | None = None
    for path in paths:
        stats = read_csv(path)
        merged = stats if merged is None else merged.merge(stats)
    if merged is None:
        raise StatsError("no statistics files given")
    return merged


def _header_int(header: dict[str, str], key: str, source: str, default: int | None) -> int | None:
    if key not in header:
        return default
    value = header[key]
    if not value.isdigit() or int(value) < 1:
        raise StatsError(f"{source}: header {key}={value!r} must be a positive integer")
    return int(value)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(handle, 0o644)  # mkstemp creates 0600; a stats file is meant to be shared
        with os.fdopen(handle, "w", encoding="utf-8") as temp:
            temp.write(text)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
