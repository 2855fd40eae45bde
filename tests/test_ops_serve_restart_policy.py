"""`moemesh serve`'s restart policy (moemesh/commands/serve_restarts.py) on real child processes:
a dead child is started again after its backoff (not before), in place in the service list, with
a restart record on disk and `serve.child_restarted` events; the backoff doubles while processes
die quickly, and a process that ran `stable_after_s` starts afresh (backoff and budget); a required
service that spends its budget stops serving (GaveUp), an optional one is dropped. The clock is a
counter the test advances, the processes are real.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from moemesh.common.runtime.launcher import ServiceProcess, stop_services
from moemesh.commands.serve_restarts import ChildRestarter, GaveUp, RestartPolicy
from moemesh.common.runtime.restart_record import read_restarts

SLEEP = "import time; time.sleep(60)"


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Launcher:
    """Starts `python -c CODE` children named like services; restarts run `next_code`."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[ServiceProcess] = []
        self.next_code = SLEEP

    def start(self, name: str, code: str, role: str = "expert") -> ServiceProcess:
        stderr_path = self.tmp_path / f"{name}.stderr"
        with open(stderr_path, "ab") as stderr:
            process = subprocess.Popen([sys.executable, "-c", code], stdout=stderr, stderr=stderr)
        service = ServiceProcess(name, role, process, stderr_path)
        self.started.append(service)
        return service

    def restart(self, service: ServiceProcess) -> ServiceProcess:
        return self.start(service.name, self.next_code, service.role)

    def stop_all(self) -> None:
        stop_services([s for s in self.started if s.exit_code is None], drain_s=5)


@pytest.fixture
def launcher(tmp_path):
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.stop_all()


def _wait_exit(service: ServiceProcess) -> None:
    service.process.wait(timeout=30)


def test_backoff_doubles_and_is_capped():
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.backoff_s(k) for k in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        RestartPolicy(initial_backoff_s=2.0, max_backoff_s=1.0)
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError):
        RestartPolicy(stable_after_s=0)


def test_dead_child_is_restarted_after_its_backoff_in_place(launcher, tmp_path):
    clock = Clock()
    router = launcher.start("router", SLEEP, role="router")
    expert = launcher.start("expert-0", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)")
    services = [router, expert]
    record_path = tmp_path / "serve_restarts.json"
    restarter = ChildRestarter(services, RestartPolicy(initial_backoff_s=2.0), launcher.restart,
                               record_path=record_path, clock=clock)
    _wait_exit(expert)
    with capture_logs() as events:
        restarter.poll()  # notices the death: restart due in 2 s
        assert services[1] is expert and restarter.pending_names() == ["expert-0"]
        assert read_restarts(record_path)["expert-0"]["pid"] is None  # down, waiting out its backoff
        clock.now_s += 1.9
        restarter.poll()
        assert services[1] is expert  # backoff not over yet
        clock.now_s += 0.2
        restarter.poll()
    replacement = services[1]
    assert replacement is not expert and replacement.name == "expert-0" and replacement.exit_code is None
    assert services[0] is router  # order kept (it is the stop order)
    names = [event["event"] for event in events]
    assert names == ["serve.child_exited", "serve.child_restarted"]
    assert events[0]["exit_code"] == 3 and "boom" in events[0]["stderr_tail"]
    assert events[1]["pid"] == replacement.process.pid
    record = read_restarts(record_path)["expert-0"]
    assert record["num_restarts"] == 1 and record["last_exit_code"] == 3 and record["pid"] == replacement.process.pid
    assert not record["gave_up"] and "router" not in read_restarts(record_path)
    restarter.poll()  # a live child is left alone
    assert services[1] is replacement and restarter.num_restarts == 1


def test_required_service_spending_its_budget_stops_serving(launcher, tmp_path):
    clock = Clock()
    launcher.next_code = "import sys; sys.exit(5)"
    services = [launcher.start("attention-0", "import sys; sys.exit(5)", role="attention")]
    record_path = tmp_path / "serve_restarts.json"
    restarter = ChildRestarter(services, RestartPolicy(initial_backoff_s=1.0, max_restarts=2, stable_after_s=100.0),
                               launcher.restart, record_path=record_path, clock=clock)
    delays = []
    for _ in range(2):
        _wait_exit(services[0])
        restarter.poll()
        start_s = clock.now_s
        while restarter.pending_names():
            clock.now_s += 0.5
            restarter.poll()
        delays.append(clock.now_s - start_s)
    assert delays == [1.0, 2.0]  # doubled: each process died within stable_after_s
    _wait_exit(services[0])
    with pytest.raises(GaveUp, match="attention-0 exited with code 5 after 2 restarts, each dead within 100s"):
        restarter.poll()
    record = read_restarts(record_path)["attention-0"]
    assert record["gave_up"] and record["num_restarts"] == 2 and record["pid"] is None


def test_a_stable_run_resets_the_streak_and_an_optional_service_is_dropped(launcher):
    clock = Clock()
    launcher.next_code = "import sys; sys.exit(7)"
    expert = launcher.start("expert-0", SLEEP)
    draft = launcher.start("draft", "import sys; sys.exit(7)", role="draft")
    services = [expert, draft]
    restarter = ChildRestarter(services, RestartPolicy(initial_backoff_s=1.0, max_restarts=1, stable_after_s=50.0),
                               launcher.restart, optional=frozenset({"draft"}), clock=clock)
    _wait_exit(draft)
    restarter.poll()
    clock.now_s += 1.0
    restarter.poll()
    assert restarter.num_restarts == 1
    # the restarted one ran 60 s (> stable_after_s) before it died: allowed again, at the initial backoff
    _wait_exit(services[1])
    clock.now_s += 60.0
    restarter.poll()
    clock.now_s += 0.9
    restarter.poll()
    assert restarter.records["draft"].num_restarts == 1  # backoff 1.0 s, not 2.0: not due yet
    clock.now_s += 0.1
    restarter.poll()
    assert restarter.records["draft"].num_restarts == 2
    _wait_exit(services[1])  # and once more at once: budget spent, the drafter is dropped
    restarter.poll()
    assert [s.name for s in services] == ["expert-0"] and restarter.given_up == ["draft"]
    assert restarter.records["draft"].gave_up
