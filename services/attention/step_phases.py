"""Where the attention worker's step time goes, by phase and by kind of step, summed since start.

A step is split at the host clock into: prepare (slots, inputs), forward (the layer loop or the graph
replay, as the host sees it: launches), sample (logits, sampling or verification and the rollback; on a GPU
this is where the host waits for the forward to finish), features (target features into the drafter's
rings or to the draft worker), draft (the in-process drafter's next blocks) and the rest (freed slots, the
result). On CUDA a pair of events around the forward also gives its device time. Steps are kept apart by
kind: `decode` (one new token per sequence), `verify` (some sequence verifies drafts), `prefill` (the rest).
The worker logs the means once, at close (`attention.step_phase_summary`), and the medians over each kind's
last `NUM_RECENT_STEPS` steps (a few slow first steps, captures and compiles, move the means, not the medians);
`moemesh bench speculation` prints them beside the drafter's own timings. Plain Python around torch.cuda.Event:
nothing per token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from statistics import median

import torch

PHASES = ("prepare", "forward", "sample", "features", "draft", "rest")
NUM_RECENT_STEPS = 2048  # per kind of step: the window the medians are taken over


@dataclass
class _KindTotals:
    num_steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    forward_device_s: float = 0.0
    num_device_timed: int = 0  # steps whose forward events had completed by the end of the step
    # the last NUM_RECENT_STEPS steps: each phase's seconds (and "total"), the forward's device seconds
    recent: dict[str, deque] = field(default_factory=lambda: {
        name: deque(maxlen=NUM_RECENT_STEPS) for name in (*PHASES, "total", "forward_device")})


class StepPhaseTimer:
    """One step's marks: `mark(phase)` closes that phase at the host clock; `forward_started` /
    `forward_done` bracket the forward with CUDA events (on a CUDA device)."""

    def __init__(self, totals: "StepPhases") -> None:
        self.totals = totals
        self.last_s = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.events: tuple | None = None

    def mark(self, phase: str) -> None:
        now_s = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now_s - self.last_s
        self.last_s = now_s

    def forward_started(self) -> None:
        if self.totals.cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()

    def forward_done(self) -> None:
        if self.events is not None:
            self.events[1].record()

    def finish(self, kind: str) -> None:
        """Close the step as `kind` (its last phase is `rest`). The forward's events count when they have
        completed (a step that sampled read its tokens back after them); a step that sampled nothing is not
        made to wait for them."""
        self.mark("rest")
        totals = self.totals.by_kind.setdefault(kind, _KindTotals())
        totals.num_steps += 1
        for phase in PHASES:
            seconds = self.seconds.get(phase, 0.0)
            totals.seconds[phase] += seconds
            totals.recent[phase].append(seconds)
        totals.recent["total"].append(sum(self.seconds.values()))
        if self.events is not None and self.events[1].query():
            device_s = self.events[0].elapsed_time(self.events[1]) / 1e3
            totals.num_device_timed += 1
            totals.forward_device_s += device_s
            totals.recent["forward_device"].append(device_s)


class StepPhases:
    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.by_kind: dict[str, _KindTotals] = {}

    def start(self) -> StepPhaseTimer:
        return StepPhaseTimer(self)

    def as_log_fields(self) -> dict[str, float | int]:
        """Per kind: its step count, then the mean ms of every phase and of the forward on the device (over the
        steps whose forward had completed by their end), and the median ms of each over the recent steps."""
        fields: dict[str, float | int] = {}
        for kind, totals in sorted(self.by_kind.items()):
            count = max(1, totals.num_steps)
            fields[f"{kind}_num_steps"] = totals.num_steps
            for phase, seconds in totals.seconds.items():
                fields[f"{kind}_{phase}_ms_mean"] = round(1e3 * seconds / count, 4)
            fields[f"{kind}_total_ms_mean"] = round(1e3 * sum(totals.seconds.values()) / count, 4)
            if self.cuda and totals.num_device_timed:
                fields[f"{kind}_forward_device_ms_mean"] = round(
                    1e3 * totals.forward_device_s / totals.num_device_timed, 4)
            for name, values in totals.recent.items():
                if values:
                    fields[f"{kind}_{name}_ms_median"] = round(1e3 * median(values), 4)
        return fields


def step_kind(plan) -> str:
    """`verify` when some sequence verifies drafts, `decode` when each computes one new token, else `prefill`."""
    sequences = plan.sequences
    if any(s.draft_token_ids for s in sequences):
        return "verify"
    if sequences and all(len(s.token_ids) == 1 for s in sequences):
        return "decode"
    return "prefill"
