"""The timing harness every benchmark uses: clocks, device syncs, medians and percentiles, floors.

- `sync(device)`: waits for the device's queued work (CUDA); nothing on the CPU.
- `time_s(fn, device)`: seconds per call of `fn`. On CUDA, CUDA events around the call (the device
  time of the work it enqueues, without a host sync in between); on the CPU, `time.perf_counter`.
- `wall_s(fn, device)`: seconds per call from the host's clock, the device synchronised before and
  after each call: host work, launches and device time together (what a caller waiting on the result sees).
- `graph_replay_s(fns)`: device seconds per fn of one CUDA graph that calls every fn once (warm-up on a
  side stream outside the capture; replays timed with events): the kernels' own time without launch gaps.
- `graph_median_s(fns)`: their median; `l2_cleared_s(fn)`: Triton's do_bench median (L2 cleared before
  each call, launch included) for calls that synchronise and so cannot be captured.
- `Marks`: consecutive named marks in one pass (events on CUDA, the host clock on the CPU) -> seconds
  between each mark and the next, for timing the pieces of a step without syncing between them.
- `median`, `percentile` (linear between order statistics), `floor_s` (bytes / bandwidth, FLOPs / rate) and
  `floor_ratio` (measured / floor: 1.0 is at the floor).
Every function that takes `device` accepts a `torch.device`, a device string or None (CPU).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

_NAN = float("nan")


def is_cuda(device: Any) -> bool:
    """Whether `device` (torch.device, string or None) is a CUDA device."""
    if device is None:
        return False
    return (device if isinstance(device, str) else getattr(device, "type", str(device))).startswith("cuda")


def sync(device: Any) -> None:
    """Wait until the work queued on `device` has run (CUDA); nothing to wait for on the CPU."""
    if is_cuda(device):
        import torch

        torch.cuda.synchronize(device)


def wall_s(fn: Callable[[], object], device: Any = None, *, warmup: int = 0, repeats: int = 5) -> list[float]:
    """Host-clock seconds of each of `repeats` calls (after `warmup` untimed ones), the device
    synchronised before and after each call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        began_s = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - began_s)
    return samples


def time_s(fn: Callable[[], object], device: Any = None, *, warmup: int = 0, repeats: int = 5) -> list[float]:
    """Seconds of each of `repeats` calls (after `warmup` untimed ones, then a sync): CUDA events around
    each call on CUDA (device time), `time.perf_counter` on the CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    if not is_cuda(device):
        samples = []
        for _ in range(repeats):
            began_s = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - began_s)
        return samples
    import torch

    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    return samples


def graph_replay_s(fns: Sequence[Callable[[], object]], *, replays: int = 30, warmup_replays: int = 3) -> list[float]:
    """Device seconds per fn of each timed replay of one CUDA graph that calls every fn in `fns` once.

    The fns run once on a side stream first (compiles, allocations), outside the capture."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    try:
        return [seconds / len(fns) for seconds in time_s(graph.replay, "cuda", warmup=warmup_replays, repeats=replays)]
    finally:
        del graph


def graph_median_s(fns: Sequence[Callable[[], object]], *, replays: int = 30) -> float:
    """Median of `graph_replay_s`: device seconds per fn, as a graph-captured step would see it."""
    return median(graph_replay_s(fns, replays=replays))


def l2_cleared_s(fn: Callable[[], object], *, rep_ms: int = 100) -> float:
    """Median seconds per call from `triton.testing.do_bench` (CUDA): L2 cleared before every call,
    host launch included; for calls that cannot be captured in a graph (they synchronise)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e-3


class Marks:
    """Named marks in one pass over a step's pieces: `mark(name)` before each piece, `seconds()` after
    the last -> {name: seconds from its mark to the next} (names repeated are summed). CUDA: events,
    read after one sync at the end; CPU: the host clock."""

    def __init__(self, device: Any = None) -> None:
        self.cuda = is_cuda(device)
        self._marks: list[tuple[str, Any]] = []

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, name: str) -> None:
        self._marks.append((name, self._now()))

    def seconds(self) -> dict[str, float]:
        """Seconds per name, ending the last piece now (waits for the device on CUDA)."""
        end = self._now()
        if self.cuda:
            end.synchronize()
        marks = self._marks + [("", end)]
        out: dict[str, float] = {}
        for (name, began), (_, ended) in zip(marks, marks[1:]):
            elapsed = began.elapsed_time(ended) * 1e-3 if self.cuda else ended - began
            out[name] = out.get(name, 0.0) + elapsed
        return out


def median(values: Sequence[float], empty: Any = _NAN) -> Any:
    """The median of `values`, or `empty` when there are none."""
    return float(statistics.median(values)) if len(values) else empty


def percentile(values: Sequence[float], fraction: float, empty: Any = _NAN) -> Any:
    """The `fraction` quantile (0..1) of `values`, linear between the two nearest order statistics
    (position fraction * (n - 1) in the sorted sample); `empty` when there are none."""
    if not len(values):
        return empty
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def floor_s(amount: float, rate_per_s: float) -> float:
    """The least time `amount` of work takes at `rate_per_s`: bytes over a bandwidth (the weight-read
    floor) or FLOPs over a matmul rate (the compute floor)."""
    return amount / rate_per_s


def floor_ratio(measured_s: float | None, floor: float | None) -> float | None:
    """measured / floor (1.0 = at the floor); None when either is missing or the floor is not positive."""
    if measured_s is None or floor is None or floor <= 0:
        return None
    return measured_s / floor
