"""What `/health` says: every needed worker is ready and beating, and the last step worked.

Two sources, both read-only here: the supervisor's record of Ready messages and
heartbeats (the router binds the deployment's supervisor endpoint), and the engine loop's
own step outcomes. A failed step (timeout, error reply) marks the attention worker down
until a later step or a Ping succeeds, so health reflects reality even while heartbeats
still arrive from a worker that stopped answering plans.

An expert worker that is down is not needed while replicas on live workers hold every pair it
held (`replica_cover`, set by the router from the placement): it is then reported as
`degraded: ...` and `/health` stays 200, because the attention worker routes its pairs to the
replicas (services/attention/failover.py). Without a cover, a down worker makes `/health` 503.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from moemesh.common.runtime.supervisor import Supervisor
from moemesh.common.wire.messages import ServiceState
from moemesh.services.router.engine_client import HealthReport
from moemesh.services.router.engine_config import EngineConfig


class HealthTracker:
    def __init__(self, config: EngineConfig, supervisor: Supervisor | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.supervisor = supervisor
        self.clock = clock
        self.step_failure: str | None = None  # why the attention worker is considered down
        self.stopping = False
        # The attention worker handles a plan without yielding, so it cannot beat during a
        # long step: a step in flight (bounded by the step timeout) or a reply counts as life.
        self.step_started_s: float | None = None
        self.last_reply_s: float | None = None
        # replica_cover(name, down_names) -> True when live replicas hold every pair of worker `name`
        self.replica_cover: Callable[[str, set[str]], bool] | None = None

    def record_step_started(self) -> None:
        self.step_started_s = self.clock()

    def record_step_ok(self) -> None:
        self.step_failure = None
        self.step_started_s = None
        self.last_reply_s = self.clock()

    def record_step_failure(self, message: str) -> None:
        self.step_failure = message
        self.step_started_s = None

    def worker_status(self, name: str) -> str:
        """"ok" or what is wrong with one required worker, from the supervisor's records."""
        supervisor = self.supervisor
        if supervisor is None:
            return "ok"  # unsupervised (tests, manual runs): only step outcomes count
        beat = supervisor.heartbeats.get(name)
        if beat is not None and beat.state is ServiceState.STOPPED:
            return "down: stopped"
        ready = name in supervisor.ready or (beat is not None and beat.state is ServiceState.READY)
        if not ready:
            return "starting: not ready yet" if beat is None else f"down: {beat.state.value}"
        seen_s = supervisor.last_seen_s.get(name)
        if name == self.config.attention_name:
            if self.step_started_s is not None:
                return "ok"  # busy with a plan; the step timeout bounds how long that may last
            if self.last_reply_s is not None:
                seen_s = max(seen_s or self.last_reply_s, self.last_reply_s)
        silence_s = None if seen_s is None else self.clock() - seen_s
        if silence_s is None or silence_s > self.config.max_heartbeat_silence_s:
            return f"down: no heartbeat for {silence_s or 0.0:.1f} s"
        return "ok"

    def report(self) -> HealthReport:
        services = {name: self.worker_status(name) for name in self.config.required_worker_names}
        if self.step_failure is not None:
            services[self.config.attention_name] = f"down: {self.step_failure}"
        if self.stopping:
            services["router"] = "down: shutting down"
        if self.replica_cover is not None:
            down = {name for name, status in services.items() if status != "ok"}
            for name in sorted(down - {self.config.attention_name, "router"}):
                if self.replica_cover(name, down):
                    services[name] = f"degraded: {services[name]}; replicas serve its experts"
        ok = all(status == "ok" or status.startswith("degraded") for status in services.values())
        return HealthReport(ok=ok, services=services)
