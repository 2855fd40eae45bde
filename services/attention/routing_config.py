"""Routing-statistics settings of the attention worker (no torch: the CLI reads it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingStatsConfig:
    """out_path: where `--routing-stats-out` writes the Lucebox hotness tables on shutdown and on
    a WriteRoutingStats request without a path (None: only on request, to the path it names).
    summary_every_steps: how often a StepResult carries the per-layer skew summary for the
    router's /metrics (None: never). Every 32 steps keeps the one device->host copy of the
    [2, L, E] counts off the per-step path."""

    out_path: str | None = None
    summary_every_steps: int | None = 32

    def __post_init__(self) -> None:
        if self.summary_every_steps is not None and self.summary_every_steps < 1:
            raise ValueError(f"summary_every_steps={self.summary_every_steps} must be at least 1 (or None: never)")
