"""/health with replicas: an expert worker that is down while live twins hold all of its pairs is
reported `degraded` and the router keeps serving; one whose pairs nobody else holds makes it 503.
The cover is computed from the deployment's placement, then from the last applied placement."""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.common.placement.placement_file import Placement, WorkerPlacement
from moemesh.common.wire.messages import Heartbeat, Ready, ServiceRole, ServiceState
from moemesh.services.router.engine_config import EngineConfig
from moemesh.services.router.engine_health import HealthTracker
from moemesh.services.router.placement_admin import PlacementAdmin

ALL = {(layer, expert) for layer in range(2) for expert in range(4)}
HALF = {(layer, expert) for layer in range(2) for expert in range(2)}


@dataclass
class Records:
    """The records of common.runtime.supervisor.Supervisor that HealthTracker reads."""

    ready: dict = field(default_factory=dict)
    heartbeats: dict = field(default_factory=dict)
    last_seen_s: dict = field(default_factory=dict)


def _tracker(now_s: float, silent: str) -> HealthTracker:
    records = Records()
    for name, role in (("attention-0", ServiceRole.ATTENTION), ("expert-0", ServiceRole.EXPERT),
                       ("expert-1", ServiceRole.EXPERT)):
        records.ready[name] = Ready(name, role, 1, f"ipc:///{name}")
        records.heartbeats[name] = Heartbeat(name, role, ServiceState.READY, 1)
        records.last_seen_s[name] = now_s - (60.0 if name == silent else 0.1)
    config = EngineConfig(attention_endpoint="ipc:///attention-0", attention_name="attention-0",
                          required_worker_names=("attention-0", "expert-0", "expert-1"), max_heartbeat_silence_s=3.0)
    return HealthTracker(config, records, clock=lambda: now_s)


def test_a_down_worker_with_live_twins_is_degraded_not_down():
    admin = PlacementAdmin(lambda name, endpoint: None, [])
    admin.deployment_holdings = {"expert-0": set(ALL), "expert-1": set(HALF)}
    tracker = _tracker(100.0, silent="expert-1")
    assert tracker.report().ok is False  # without the cover: any required worker down -> 503
    tracker.replica_cover = admin.replica_cover
    report = tracker.report()
    assert report.ok is True and report.services["expert-1"].startswith("degraded: down: no heartbeat")

    tracker = _tracker(100.0, silent="expert-0")  # expert-0 alone holds experts 2 and 3
    tracker.replica_cover = admin.replica_cover
    report = tracker.report()
    assert report.ok is False and report.services["expert-0"].startswith("down:")


def test_the_cover_follows_the_applied_placement():
    admin = PlacementAdmin(lambda name, endpoint: None, [])
    admin.deployment_holdings = {"expert-0": set(ALL), "expert-1": set(HALF)}
    assert admin.replica_cover("expert-1", {"expert-1"}) is True
    admin.current_placement = Placement(2, 4, 1, (
        WorkerPlacement("expert-0", "cpu", tuple(sorted(ALL - HALF))),
        WorkerPlacement("expert-1", "cpu", tuple(sorted(HALF))),
    ))
    admin.placement_version = 1
    assert admin.replica_cover("expert-1", {"expert-1"}) is False  # no copy of experts 0-1 elsewhere now
    assert admin.replica_cover("expert-9", {"expert-9"}) is True  # holds nothing: not needed


def test_without_known_holdings_every_down_worker_is_needed():
    admin = PlacementAdmin(lambda name, endpoint: None, [])  # the deployment's placement was unreadable
    assert admin.replica_cover("expert-1", {"expert-1"}) is False
