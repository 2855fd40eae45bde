"""Per-(layer, expert) activation counts of the attention worker, split by phase.

`RoutingCounter.add(layer, ids, is_decode)` runs once per MoE layer and micro-batch with the
gate's top-k ids. It adds one to a device tensor [P, L, E] per selected slot (P = 2 phases: prefill,
decode) and never syncs with the host, so counting costs one small kernel per layer (`route_counts`). The host
sees the counts only when asked: `snapshot()` (one device->host copy) builds a
`common.placement.stats.RoutingStats`, which writes Lucebox hotness tables
(`write_stats_files`) and computes per-layer skew (`summary()`, sent to the router in a
`StepResult` every `summary_every_steps` steps for `/metrics`, with the raw [L][E] counts for
the status page's heat map).

Phases: a token is a prefill token when it is part of the prompt (scheduled while its sequence
has no output tokens yet) and a decode token otherwise; the worker decides per sequence and
passes one bool per token. A captured step graph passes phase indices instead (int64 [T]: 0, 1,
or `NOT_COUNTED` for its padding rows), counted into a third plane that nothing reads.
Legend: T tokens, K top-k slots, L layers, E routed experts, P phases (0 prefill, 1 decode).
"""

from __future__ import annotations

from pathlib import Path

import structlog
import torch

from moemesh.common.kernels.route_counts import count_routes
from moemesh.common.placement.stats import Phase, RoutingStats, write_stats_files
from moemesh.common.wire.messages import LayerRoutingSkew, RoutingPhase, RoutingSummary
from moemesh.services.attention.routing_config import RoutingStatsConfig  # noqa: F401  (re-exported)

log = structlog.get_logger("attention")

_PHASES = (Phase.PREFILL, Phase.DECODE)  # index along P
NOT_COUNTED = len(_PHASES)  # the phase index of rows that are not counted (a step graph's padding)
_WIRE_PHASES = {Phase.PREFILL: RoutingPhase.PREFILL, Phase.DECODE: RoutingPhase.DECODE, Phase.UNSPLIT: RoutingPhase.ALL}


class RoutingCounter:
    """Device-side activation counts. Invariant: `counts` is [P, L, E] int64, only ever added to (or
    zeroed whole by `forget`)."""

    def __init__(self, num_layers: int, num_experts: int, num_experts_per_tok: int, device: torch.device,
                 summary_every_steps: int | None = None) -> None:
        if summary_every_steps is not None and summary_every_steps < 1:
            raise ValueError(f"summary_every_steps={summary_every_steps} must be at least 1 (or None: never)")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.summary_every_steps = summary_every_steps
        # [P + 1, L, E]: the phases, then the plane of rows not counted; `counts` [P, L, E] views the phases
        self._planes = torch.zeros(len(_PHASES) + 1, num_layers, num_experts, dtype=torch.long, device=device)
        self.counts = self._planes[: len(_PHASES)]
        self.num_steps = 0

    def step_done(self) -> RoutingSummary | None:
        """Count one executed step; the summary when one is due (every summary_every_steps), else None."""
        self.num_steps += 1
        if self.summary_every_steps is None or self.num_steps % self.summary_every_steps:
            return None
        return self.summary()

    def add(self, layer: int, ids: torch.Tensor, is_decode: torch.Tensor | None) -> None:
        """ids [T, K] expert ids of one layer; is_decode [T] bool, or int64 phase indices where
        `NOT_COUNTED` marks rows to leave out (None: every token is prefill)."""
        # One launch on the GPU (`common/kernels/route_counts.py`); both paths have a fixed output size, so
        # unlike bincount (which reads max(ids) back to size its output) they never wait for the device.
        count_routes(self._planes, layer, ids, is_decode.to(device=ids.device) if is_decode is not None else None)

    def forget(self) -> None:
        """Drop every count and the step count (after the router's start-time warm-up: its synthetic
        steps must not steer a placement planned from these statistics)."""
        self._planes.zero_()
        self.num_steps = 0

    def snapshot(self) -> RoutingStats:
        """The counts so far as a RoutingStats (one device->host copy)."""
        host = self.counts.cpu().tolist()  # [P][L][E]
        stats = RoutingStats(self.num_layers, self.num_experts, self.num_experts_per_tok)
        for index, phase in enumerate(_PHASES):
            for layer in range(self.num_layers):
                stats.add_counts(phase, layer, host[index][layer])
        return stats

    def summary(self, stats: RoutingStats | None = None) -> RoutingSummary:
        """Per-layer skew for each measured phase and for all phases together."""
        stats = self.snapshot() if stats is None else stats
        layers = []
        for phase in (*_PHASES, Phase.UNSPLIT):
            if phase is not Phase.UNSPLIT and not stats.has_phase(phase):
                continue
            phases = _PHASES if phase is Phase.UNSPLIT else (phase,)
            for skew in stats.skews(phases):
                layers.append(LayerRoutingSkew(
                    layer=skew.layer, phase=_WIRE_PHASES[phase], num_activations=skew.num_activations,
                    max_over_mean=skew.max_over_mean, top8_share=skew.top8_share,
                    effective_experts=skew.effective_experts, num_unused=skew.num_unused))
        counts = tuple(tuple(row) for row in stats.counts())  # [L][E], every phase summed (the heat map)
        return RoutingSummary(num_steps=self.num_steps, layers=tuple(layers), layer_counts=counts)

    def write(self, path: str | Path) -> list[Path]:
        """Write the hotness tables (`path` for all phases, `.prefill.csv` / `.decode.csv` beside it)."""
        stats = self.snapshot()
        written = write_stats_files(path, stats)
        log.info("attention.routing_stats_written", paths=[str(p) for p in written], num_steps=self.num_steps,
                 num_activations=stats.num_activations())
        return written
