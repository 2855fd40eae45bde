"""Startup memory budget: the report adds up, and a shortfall fails fast naming device and bytes."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from moemesh.common.placement.budget import BudgetShortfall, MemoryBudget, check_all, report_and_check

GIB = 2**30


def budget(free_gib: float, device: str = "cuda:0", **items_gib: float) -> MemoryBudget:
    return MemoryBudget("expert", device, int(free_gib * GIB), **{k: int(v * GIB) for k, v in items_gib.items()})


def test_report_adds_every_item():
    b = budget(100, weights_bytes=4, kv_pool_bytes=30, activation_bytes=2, graph_bytes=1, expert_bytes=60,
               reserve_bytes=1)
    assert b.needed_bytes == 98 * GIB and b.headroom_bytes == 2 * GIB and b.fits
    text = "\n".join(b.report_lines())
    for label in ("weights", "kv pools", "activations", "graphs", "experts", "reserve", "free", "left"):
        assert label in text
    b.check()


def test_shortfall_names_device_and_missing_bytes():
    b = budget(80, device="cuda:1", weights_bytes=10, expert_bytes=75)
    assert not b.fits and b.headroom_bytes == -5 * GIB
    with pytest.raises(BudgetShortfall) as error:
        b.check()
    message = str(error.value)
    assert "expert on cuda:1" in message and "short by 5.00 GiB" in message and "80.00 GiB is free" in message
    assert "SHORT" in "\n".join(b.report_lines())


def test_report_and_check_logs_one_structured_event():
    with capture_logs() as logs:
        report_and_check(budget(10, weights_bytes=1))
    assert logs[0]["event"] == "expert.memory_budget" and logs[0]["fits"] is True
    assert logs[0]["weights_bytes"] == GIB and logs[0]["log_level"] == "info"
    with capture_logs() as logs, pytest.raises(BudgetShortfall):
        report_and_check(budget(1, expert_bytes=2))
    assert logs[0]["log_level"] == "error" and logs[0]["headroom_bytes"] == -GIB


def test_check_all_lists_every_failing_device():
    with pytest.raises(BudgetShortfall) as error:
        check_all([budget(1, "cuda:0", expert_bytes=2), budget(5, "cuda:1", expert_bytes=1),
                   budget(1, "cpu", weights_bytes=3)])
    assert "cuda:0" in str(error.value) and "cpu" in str(error.value) and "cuda:1" not in str(error.value)
    check_all([budget(5, "cuda:1", expert_bytes=1)])


def test_negative_items_are_rejected():
    with pytest.raises(ValueError, match="kv pools=-1"):
        MemoryBudget("attention", "cuda:0", 10, kv_pool_bytes=-1)
