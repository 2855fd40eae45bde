"""The router's registry of expert workers: a Ready from an expert worker registers it with its
inventory, a restart (new pid) re-registers it and reloads it, a STOPPED heartbeat or silence marks
it gone, and the status page's placement view follows. Pure Python: the supervisor's records are
filled with real wire messages, the inventory comes from a query function."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from moemesh.common.wire.messages import ExpertInventory, ExpertKey, Heartbeat, Ready, ServiceRole, ServiceState
from moemesh.services.router.expert_registry import ExpertRegistry


@dataclass
class Records:
    """The three dicts of common.runtime.supervisor.Supervisor the registry reads."""

    ready: dict = field(default_factory=dict)
    heartbeats: dict = field(default_factory=dict)
    last_seen_s: dict = field(default_factory=dict)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _inventory(name: str, pairs, free_budget_bytes=1000) -> ExpertInventory:
    return ExpertInventory(name=name, device="cpu", placement_version=0,
                           experts=tuple(ExpertKey(l, e) for l, e in pairs), num_weight_bytes=10 * len(pairs),
                           memory_used_bytes=0, free_budget_bytes=free_budget_bytes)


def test_registration_restart_and_departure():
    records, clock = Records(), Clock()
    holdings = {"expert-0": [(0, 0), (0, 1), (1, 0)], "expert-9": []}
    queries, restarts = [], []

    def query(name, endpoint):
        queries.append((name, endpoint))
        return _inventory(name, holdings[name])

    registry = ExpertRegistry(records, query, max_silence_s=3.0, clock=clock,
                              on_restart=lambda name, endpoint: restarts.append(name))
    view = {"expert-0": {0: [0, 1, 2, 3]}}  # the deployment's placement, before any registration
    registry.bind_view(view)
    records.ready["attention-0"] = Ready("attention-0", ServiceRole.ATTENTION, 10, "ipc:///a")
    records.ready["expert-0"] = Ready("expert-0", ServiceRole.EXPERT, 11, "ipc:///e0", "cpu")
    records.ready["expert-9"] = Ready("expert-9", ServiceRole.EXPERT, 12, "ipc:///e9", "cuda:1")
    records.last_seen_s.update({"expert-0": clock.now_s, "expert-9": clock.now_s})
    asyncio.run(registry.refresh())
    assert sorted(queries) == [("expert-0", "ipc:///e0"), ("expert-9", "ipc:///e9")]  # experts only
    assert registry.endpoints() == {"expert-0": "ipc:///e0", "expert-9": "ipc:///e9"}
    snapshot = {w["name"]: w for w in registry.snapshot()}
    assert snapshot["expert-0"]["num_experts"] == 3 and snapshot["expert-0"]["experts_by_layer"] == {"0": [0, 1],
                                                                                                     "1": [0]}
    assert snapshot["expert-9"]["device"] == "cuda:1" and snapshot["expert-9"]["free_budget_bytes"] == 1000
    assert view == {"expert-0": {0: [0, 1], 1: [0]}, "expert-9": {}}

    asyncio.run(registry.refresh())  # nothing new: no query, no restart
    assert len(queries) == 2 and restarts == []

    records.ready["expert-0"] = Ready("expert-0", ServiceRole.EXPERT, 21, "ipc:///e0", "cpu")  # restarted
    asyncio.run(registry.refresh())
    assert restarts == ["expert-0"] and registry.workers["expert-0"].pid == 21

    holdings["expert-9"] = [(1, 1)]
    registry.note_inventory(_inventory("expert-9", [(1, 1)], free_budget_bytes=990))  # after a LoadExperts
    assert view["expert-9"] == {1: [1]} and registry.workers["expert-9"].free_budget_bytes == 990

    records.heartbeats["expert-9"] = Heartbeat("expert-9", ServiceRole.EXPERT, ServiceState.STOPPED, 5)
    del records.ready["expert-9"]  # the supervisor forgets a stopped worker's Ready
    clock.now_s += 1.0
    records.last_seen_s["expert-0"] = clock.now_s
    asyncio.run(registry.refresh())
    assert registry.workers["expert-9"].state == "gone" and "expert-9" not in registry.endpoints()
    assert "expert-9" not in view

    clock.now_s += 10.0  # expert-0 killed: no STOPPED, only silence
    asyncio.run(registry.refresh())
    assert registry.workers["expert-0"].state == "gone" and registry.endpoints() == {}


def test_a_worker_that_does_not_answer_is_unreachable_and_retried():
    records, clock = Records(), Clock()
    answers = [TimeoutError("no reply"), _inventory("expert-1", [(0, 0)])]
    registry = ExpertRegistry(records, lambda name, endpoint: answers.pop(0), clock=clock)
    records.ready["expert-1"] = Ready("expert-1", ServiceRole.EXPERT, 5, "ipc:///e1")
    records.last_seen_s["expert-1"] = clock.now_s
    asyncio.run(registry.refresh())
    assert registry.workers["expert-1"].state == "unreachable"
    asyncio.run(registry.refresh())
    assert registry.workers["expert-1"].state == "ready" and registry.workers["expert-1"].num_experts == 1


def test_the_router_side_of_placement_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, moemesh.services.router.main, moemesh.services.router.expert_registry, moemesh.services.router.placement_admin, "
            "moemesh.services.router.engine_health; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
