"""The service skeleton in a real child process: Ready, heartbeats, drain on SIGTERM, exit 0."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from moemesh.common.wire import messages as m
from moemesh.common.wire.transport import AsyncClient, Kind, pack_envelope
from moemesh.common.runtime.supervisor import Supervisor

CHILD = Path(__file__).resolve().parent / "wire_support.py"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_child_service_ready_heartbeats_and_drains_on_signal(tmp_path, signum):
    endpoint = f"ipc://{tmp_path}/child.sock"
    supervisor_endpoint = f"ipc://{tmp_path}/supervisor.sock"
    log_dir = tmp_path / "logs"

    async def scenario():
        context = zmq.asyncio.Context()
        supervisor = Supervisor(supervisor_endpoint, context=context)
        supervisor_task = asyncio.create_task(supervisor.run())
        child = subprocess.Popen([sys.executable, str(CHILD), endpoint, supervisor_endpoint, str(log_dir)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = AsyncClient(endpoint, context=context, default_timeout_s=10)
        try:
            ready = await supervisor.wait_ready(["slow-echo"], timeout_s=60)
            assert ready["slow-echo"].pid == child.pid and ready["slow-echo"].role is m.ServiceRole.DRAFT
            started = time.monotonic()
            while supervisor.heartbeats.get("slow-echo", None) is None or supervisor.heartbeats["slow-echo"].sequence < 2:
                assert time.monotonic() - started < 10, "no heartbeats"
                await asyncio.sleep(0.05)
            assert supervisor.is_alive("slow-echo", max_silence_s=5)

            # garbage does not take the loop down
            raw = context.socket(zmq.DEALER)
            raw.connect(endpoint)
            await raw.send_multipart([b"junk"])
            await raw.send_multipart([pack_envelope(Kind.REQUEST, 1), b"\xff\x00garbage", b"more"])
            assert await raw.poll(5000)
            raw.close(0)
            assert await client.request(m.Ping(nonce=7)) == m.Pong(nonce=7, name="slow-echo")

            # one request in flight (400 ms), one queued behind it, then the signal
            in_flight = asyncio.create_task(client.request(m.DraftRequest(step_id=400, slots=())))
            queued = asyncio.create_task(client.request(m.DraftRequest(step_id=0, slots=())))
            await asyncio.sleep(0.15)
            child.send_signal(signum)
            assert await in_flight == m.DraftTokens(step_id=400, proposals=())  # finished, answered
            refused = await queued
            assert isinstance(refused, m.ErrorReply) and refused.code is m.ErrorCode.DRAINING
            exit_code = await asyncio.to_thread(child.wait, 10)
            assert exit_code == 0, child.stderr.read().decode()[-2000:]
            started = time.monotonic()
            while "slow-echo" in supervisor.ready:  # the final Heartbeat(STOPPED) removes it
                assert time.monotonic() - started < 5
                await asyncio.sleep(0.02)
            assert supervisor.heartbeats["slow-echo"].state is m.ServiceState.STOPPED
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(5)
            await client.close()
            supervisor_task.cancel()
            supervisor.close()
            context.term()

    asyncio.run(scenario())
    events = [json.loads(line) for line in (log_dir / "slow-echo.log").read_text().splitlines()]
    names = [event["event"] for event in events]
    assert names.index("service.ready") < names.index("service.draining") < names.index("service.stopped")
    assert "wire.dropped" in names
    assert all(event["service"] == "slow-echo" and event["pid"] > 0 for event in events)
