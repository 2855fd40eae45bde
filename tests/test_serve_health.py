"""/health's source of truth: the supervisor's Ready/heartbeat records (real sockets) and step outcomes."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from moemesh.common.runtime.supervisor import Supervisor
from moemesh.common.wire.messages import Heartbeat, Ready, ServiceRole, ServiceState
from moemesh.common.wire.transport import AsyncClient
from moemesh.services.router.engine_config import EngineConfig
from moemesh.services.router.engine_health import HealthTracker


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_health_follows_readiness_heartbeats_and_steps(tmp_path):
    async def scenario():
        context = zmq.asyncio.Context()
        endpoint = f"ipc://{tmp_path}/supervisor.sock"
        supervisor = Supervisor(endpoint, context=context)
        task = asyncio.create_task(supervisor.run())
        client = AsyncClient(endpoint, context=context)
        clock = Clock()
        config = EngineConfig(attention_endpoint="ipc://unused", required_worker_names=("attention-0", "expert-0"),
                              max_heartbeat_silence_s=5.0)
        tracker = HealthTracker(config, supervisor, clock=clock)

        async def send(message) -> None:
            before = dict(supervisor.last_seen_s)
            await client.notify(message)
            for _ in range(200):
                if supervisor.last_seen_s != before:
                    break
                await asyncio.sleep(0.005)
            supervisor.last_seen_s[message.name] = clock.now_s  # on the test's clock

        reports = {"start": tracker.report()}
        await send(Ready(name="attention-0", role=ServiceRole.ATTENTION, pid=1, endpoint="ipc://a"))
        reports["attention_only"] = tracker.report()
        await send(Ready(name="expert-0", role=ServiceRole.EXPERT, pid=2, endpoint="ipc://e"))
        reports["all_ready"] = tracker.report()
        clock.now_s += 4.0
        await send(Heartbeat(name="expert-0", role=ServiceRole.EXPERT, state=ServiceState.READY, sequence=1))
        clock.now_s += 4.0  # attention silent for 8 s, expert for 4 s
        reports["attention_silent"] = tracker.report()
        tracker.record_step_started()
        reports["attention_busy"] = tracker.report()
        tracker.record_step_failure("attention worker did not answer within 30.0s")
        reports["step_failed"] = tracker.report()
        tracker.record_step_ok()
        reports["step_ok"] = tracker.report()
        await send(Heartbeat(name="expert-0", role=ServiceRole.EXPERT, state=ServiceState.STOPPED, sequence=2))
        reports["expert_stopped"] = tracker.report()
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        supervisor.close()
        context.term()
        return reports

    reports = asyncio.run(scenario())
    assert not reports["start"].ok
    assert reports["start"].services == {"attention-0": "starting: not ready yet", "expert-0": "starting: not ready yet"}
    assert not reports["attention_only"].ok and reports["attention_only"].services["attention-0"] == "ok"
    assert reports["all_ready"].ok
    assert not reports["attention_silent"].ok
    assert reports["attention_silent"].services["attention-0"].startswith("down: no heartbeat for 8.0")
    assert reports["attention_silent"].services["expert-0"] == "ok"
    assert reports["attention_busy"].ok  # a plan in flight is not silence
    assert not reports["step_failed"].ok and "did not answer" in reports["step_failed"].services["attention-0"]
    assert reports["step_ok"].ok  # a reply is proof of life
    assert reports["expert_stopped"].services["expert-0"] == "down: stopped" and not reports["expert_stopped"].ok


def test_unsupervised_health_depends_on_steps_only():
    tracker = HealthTracker(EngineConfig(attention_endpoint="ipc://unused", required_worker_names=("attention-0",)),
                            None)
    assert tracker.report().ok
    tracker.record_step_failure("refused")
    assert not tracker.report().ok
    tracker.stopping = True
    tracker.record_step_ok()
    assert tracker.report().services["router"] == "down: shutting down"
