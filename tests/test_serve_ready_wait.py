"""`moemesh serve`'s wait for readiness: --ready-timeout bounds a wait without progress, and each wave of the
router's start-time warm-up is progress (a full-width model's warm-up may outlast the timeout in all)."""

from __future__ import annotations

import pytest

from moemesh.commands import serve


class _FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def monotonic(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


def _run(monkeypatch, health_at, timeout_s: float) -> str:
    """_wait_ready against a /health that answers health_at(now_s) -> (ok, statuses)."""
    clock = _FakeClock()
    monkeypatch.setattr(serve.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(serve.time, "sleep", clock.sleep)
    monkeypatch.setattr(serve, "_health", lambda url: health_at(clock.now_s))
    return serve._wait_ready("http://unused/health", [], serve._StopRequested(), timeout_s)


def test_warm_up_waves_keep_serve_waiting_past_the_timeout(monkeypatch):
    def health_at(now_s):
        if now_s < 5:
            return False, {"router": "starting", "attention-0": "loading"}
        if now_s < 50:  # ten waves of 4.5 s each against a 10 s timeout
            return False, {"router": f"warming up: wave {int((now_s - 5) // 4.5) + 1} of 10 (x)"}
        return True, {"router": "ok"}

    assert _run(monkeypatch, health_at, timeout_s=10.0) == "ready"


@pytest.mark.parametrize("stuck", [{"router": "warming up: wave 3 of 10 (context_131076)"},
                                   {"router": "starting", "attention-0": "loading"}])
def test_no_progress_for_the_timeout_gives_up(monkeypatch, stuck):
    def health_at(now_s):
        if now_s < 2 and stuck["router"].startswith("warming"):
            return False, {"router": "warming up: wave 2 of 10 (x)"}
        return False, stuck

    outcome = _run(monkeypatch, health_at, timeout_s=10.0)
    assert outcome.startswith("not ready after") and "10s without progress" in outcome
