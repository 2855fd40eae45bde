"""Shared pieces of the host-work benchmark (`moemesh bench hostwork`, bench/hostwork.py): the V4-Flash
routing shape, stage ticks, the synchronising-call counter, the CUDA API call profile and per-variant samples.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from moemesh.bench.timing import median, sync

NUM_EXPERTS = 256
TOP_K = 6
HIDDEN = 4096
NUM_LAYERS = 43  # the dispatcher's tables are full depth (some per-layer host work scales with L x E)


def _tick(stages: dict[str, float], name: str, began: float) -> float:
    now = time.perf_counter()
    stages[name] = stages.get(name, 0.0) + (now - began) * 1e6
    return now


class SyncCounter:
    """Counts torch's synchronising calls (sync debug mode "warn") inside `with` blocks; CPU: always 0."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.count = 0

    def __enter__(self):
        if self.enabled:
            self._catcher = warnings.catch_warnings(record=True)
            self._records = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            torch.cuda.set_sync_debug_mode("default")
            self.count += sum("synchroniz" in str(r.message) for r in self._records)
            self._catcher.__exit__(*exc)


def profile_calls(device: torch.device, run, num_calls: int = 10) -> dict[str, float]:
    """CUDA runtime / driver API calls per call of `run()` (torch.profiler): launches, copies, syncs."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    run()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_calls):
            run()
        sync(device)
    counts: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key.startswith("cu") and not event.key.startswith("cudaDeviceSynchronize"):
            counts[event.key] = event.count / num_calls
    return dict(sorted(counts.items()))


class Samples:
    """Per-iteration stage times (µs) of one variant -> medians (robust to a shared machine's spikes),
    the mean total, and synchronising calls per iteration."""

    def __init__(self, device: torch.device) -> None:
        self.counter = SyncCounter(device)
        self.rows: list[dict[str, float]] = []

    def add(self, stages: dict[str, float], warm: bool) -> None:
        if warm:
            self.rows.append(stages)
        else:
            self.counter.count = 0

    def summary(self) -> dict[str, float]:
        names = list(dict.fromkeys(name for row in self.rows for name in row))
        out = {name: median([row.get(name, 0.0) for row in self.rows]) for name in names}
        out["mean_total"] = statistics.fmean(row["total"] for row in self.rows)
        out["syncs"] = self.counter.count / max(len(self.rows), 1)
        return out
