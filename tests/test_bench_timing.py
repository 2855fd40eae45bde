"""bench.timing: the one timing harness of the benchmarks (CPU paths; the CUDA paths run in the device scripts)."""

from __future__ import annotations

import math
import time

import pytest

from moemesh.bench.timing import Marks, floor_ratio, floor_s, is_cuda, median, percentile, sync, time_s, wall_s


def test_median_and_percentile():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert math.isnan(median([]))
    assert median([], empty=None) is None
    assert percentile([1, 2, 3, 4], 0.9) == pytest.approx(3.7)
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([4, 1, 3, 2], 0.0) == 1 and percentile([4, 1, 3, 2], 1.0) == 4
    assert percentile([], 0.5, empty=0.0) == 0.0


def test_floors():
    assert floor_s(4e9, 2e12) == pytest.approx(2e-3)
    assert floor_ratio(3e-3, floor_s(4e9, 2e12)) == pytest.approx(1.5)
    assert floor_ratio(None, 1.0) is None and floor_ratio(1.0, 0.0) is None


def test_device_kinds():
    assert is_cuda("cuda:1") and not is_cuda("cpu") and not is_cuda(None)
    sync("cpu")  # nothing to wait for


@pytest.mark.parametrize("clock", [time_s, wall_s])
def test_cpu_clocks_time_each_call_after_the_warmup(clock):
    calls = []

    def sleep_once():
        calls.append(None)
        time.sleep(0.002)

    samples = clock(sleep_once, "cpu", warmup=2, repeats=3)
    assert len(calls) == 5 and len(samples) == 3
    assert all(0.0015 < s < 0.5 for s in samples)


def test_marks_time_consecutive_pieces_and_sum_repeated_names():
    marks = Marks("cpu")
    for _ in range(2):
        marks.mark("short")
        time.sleep(0.001)
        marks.mark("long")
        time.sleep(0.004)
    seconds = marks.seconds()
    assert set(seconds) == {"short", "long"}
    assert seconds["long"] > seconds["short"] >= 0.0015
