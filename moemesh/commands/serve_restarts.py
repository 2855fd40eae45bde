"""`moemesh serve` restarts a service that dies, like systemd's Restart=on-failure would.

    child exits -> serve.child_exited (warning) -> wait the backoff -> start the same command
    -> serve.child_restarted (warning) -> record in <run_dir>/serve_restarts.json

Crash loops, not deaths, are what the policy limits. A process that ran `stable_after_s` or
longer before it died was healthy: its death starts a fresh streak (backoff `initial_backoff_s`).
One that died sooner continues the streak k: backoff `initial_backoff_s * 2**k`, capped at
`max_backoff_s`, and after `max_restarts` quick deaths in a row the next one is not transient
(a bug, a bad config, a broken device), so serve gives up: for a required service it stops
serving (exit 1, as before restarts existed), for an optional one (the drafter) it goes on
without it. (A window count instead, systemd's StartLimitBurst, made a worker killed every two
minutes wait out ever longer backoffs, beyond the attention worker's step-recovery budget: the
soak measured that.)

What recovers the rest of the system is theirs, not serve's: the attention worker retries a
step lost to a dead expert worker once the restarted one answers Pings (services/attention/
recovery.py); the router reconnects to a restarted attention worker (ZeroMQ reconnects; the
engine starts its KV bookkeeping afresh when the worker's pid changes) and a restarted router
sees the workers' next heartbeats. Runs on serve's main thread only: children get
PR_SET_PDEATHSIG, which fires when the *thread* that forked them exits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from moemesh.common.runtime.launcher import ServiceProcess
from moemesh.common.runtime.restart_record import ChildRestarts, write_restarts

log = structlog.get_logger("serve")


@dataclass(frozen=True)
class RestartPolicy:
    """How patiently serve restarts a dying service (see the module docstring)."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_restarts: int = 5
    stable_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s")
        if self.max_restarts < 0 or self.stable_after_s <= 0:
            raise ValueError("need max_restarts >= 0 and stable_after_s > 0")

    def backoff_s(self, num_quick_deaths: int) -> float:
        return min(self.max_backoff_s, self.initial_backoff_s * 2.0 ** num_quick_deaths)


class GaveUp(Exception):
    """A required service spent its restart budget."""


@dataclass
class _Pending:
    due_s: float
    exit_code: int


class ChildRestarter:
    """Watches `services` (a list it updates in place: a restarted service replaces the dead one
    at the same index, so the stop order stays router, attention, experts, drafter).

    `restart(service)` starts the replacement (launcher.restart_service in serve; tests
    pass the same). `optional` names services serving goes on without once their budget is spent.
    """

    def __init__(self, services: list[ServiceProcess], policy: RestartPolicy,
                 restart: Callable[[ServiceProcess], ServiceProcess], *, record_path: Path | None = None,
                 optional: frozenset[str] = frozenset(), clock: Callable[[], float] = time.monotonic) -> None:
        self.services = services
        self.policy = policy
        self._restart = restart
        self._record_path = record_path
        self._optional = optional
        self._clock = clock
        self._started_s = {service.name: clock() for service in services}  # at the latest (a lower bound of uptime)
        self._streak: dict[str, int] = {}  # restarts since the last process that ran stable_after_s
        self._pending: dict[str, _Pending] = {}
        self.records: dict[str, ChildRestarts] = {}
        self.given_up: list[str] = []  # optional services dropped after their budget

    @property
    def num_restarts(self) -> int:
        return sum(record.num_restarts for record in self.records.values())

    def poll(self) -> None:
        """Notice deaths, start replacements whose backoff has passed. Raises GaveUp when a
        required service died once more than its budget allows."""
        now_s = self._clock()
        for index, service in enumerate(list(self.services)):
            name = service.name
            if name not in self._pending:
                exit_code = service.exit_code
                if exit_code is None:
                    continue
                self._on_exit(service, exit_code, now_s)
                if name in self.given_up:
                    self.services.remove(service)
                    continue
            pending = self._pending[name]
            if now_s >= pending.due_s:
                del self._pending[name]
                replacement = self._restart(service)
                self.services[self.services.index(service)] = replacement
                self._started_s[name] = now_s
                self._streak[name] = self._streak.get(name, 0) + 1
                previous = self.records.get(name)
                record = ChildRestarts(num_restarts=(previous.num_restarts if previous else 0) + 1,
                                       last_exit_code=pending.exit_code, last_restart_unix_s=time.time(),
                                       pid=replacement.process.pid)
                self.records[name] = record
                log.warning("serve.child_restarted", name=name, role=service.role, pid=record.pid,
                            exit_code=pending.exit_code, num_restarts=record.num_restarts)
                self._write()

    def _on_exit(self, service: ServiceProcess, exit_code: int, now_s: float) -> None:
        name = service.name
        if now_s - self._started_s.get(name, now_s) >= self.policy.stable_after_s:
            self._streak[name] = 0  # it ran long enough: a new fault, not a crash loop
        streak = self._streak.get(name, 0)
        if streak >= self.policy.max_restarts:
            previous = self.records.get(name)
            self.records[name] = ChildRestarts(num_restarts=previous.num_restarts if previous else 0,
                                               last_exit_code=exit_code, last_restart_unix_s=(
                                                   previous.last_restart_unix_s if previous else None),
                                               pid=None, gave_up=True)
            self._write()
            log.error("serve.child_gave_up", name=name, role=service.role, exit_code=exit_code,
                      num_quick_restarts=streak, stable_after_s=self.policy.stable_after_s,
                      stderr_tail=service.stderr_tail(5)[-500:])
            if name in self._optional:
                self.given_up.append(name)
                return
            raise GaveUp(f"{name} exited with code {exit_code} after {streak} restarts, each dead within "
                         f"{self.policy.stable_after_s:.0f}s; giving up:\n{service.stderr_tail()}")
        backoff_s = self.policy.backoff_s(streak)
        self._pending[name] = _Pending(due_s=now_s + backoff_s, exit_code=exit_code)
        previous = self.records.get(name)
        self.records[name] = ChildRestarts(num_restarts=previous.num_restarts if previous else 0,
                                           last_exit_code=exit_code, last_restart_unix_s=(
                                               previous.last_restart_unix_s if previous else None), pid=None)
        self._write()
        log.warning("serve.child_exited", name=name, role=service.role, exit_code=exit_code,
                    restart_in_s=round(backoff_s, 3), stderr_tail=service.stderr_tail(5)[-500:])

    def pending_names(self) -> list[str]:
        return sorted(self._pending)

    def _write(self) -> None:
        if self._record_path is None:
            return
        try:
            write_restarts(self._record_path, self.records)
        except OSError as error:  # display only: restarting goes on without the file
            log.warning("serve.restart_record_failed", path=str(self._record_path), error=str(error))
