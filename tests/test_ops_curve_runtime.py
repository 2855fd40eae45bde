"""CURVE wired into the runtime: a `ServiceRunner` and a `Supervisor` built with a CURVE
`SocketSecurity` talk to each other (Ready, heartbeats) and admit only allow-listed clients.

Real sockets, real authenticators; the service is a tiny echo `Service` in the same event loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq.asyncio

from moemesh.common.runtime.service import Service, ServiceConfig, ServiceRunner
from moemesh.common.runtime.supervisor import Supervisor
from moemesh.common.security.curve import generate_key_pair
from moemesh.common.security.socket_security import SocketSecurity
from moemesh.common.wire import messages as m
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.transport import AsyncClient
from security_support import make_keys

pytestmark = pytest.mark.timeout(60)


class _Echo(Service):
    accepts = (m.DraftRequest,)

    async def handle(self, message):
        return m.DraftTokens(step_id=message.step_id, proposals=())


def _security(own, keys_dir: Path, servers: dict[str, bytes]) -> SocketSecurity:
    return SocketSecurity(own_keys=own, server_keys_by_endpoint=servers, allowed_clients_dir=keys_dir)


def test_runner_and_supervisor_speak_curve_and_refuse_strangers(tmp_path):
    keys_dir = tmp_path / "keys"
    keys = make_keys(keys_dir, "router", "expert-0", "attention-0")
    service_endpoint = f"ipc://{tmp_path}/expert-0.sock"
    supervisor_endpoint = f"ipc://{tmp_path}/supervisor.sock"
    router_security = _security(keys["router"], keys_dir, {service_endpoint: keys["expert-0"].public_key})
    service_security = _security(keys["expert-0"], keys_dir, {supervisor_endpoint: keys["router"].public_key})
    attention_security = _security(keys["attention-0"], keys_dir, {service_endpoint: keys["expert-0"].public_key})
    stranger = generate_key_pair("stranger")  # not in keys_dir: must be refused
    stranger_security = SocketSecurity(own_keys=stranger, server_keys_by_endpoint={
        service_endpoint: keys["expert-0"].public_key}, allowed_clients_dir=tmp_path)

    async def scenario():
        context = zmq.asyncio.Context()
        supervisor = Supervisor(supervisor_endpoint, context=context, security=router_security)
        assert supervisor.authenticator is not None
        supervisor_task = asyncio.create_task(supervisor.run())
        runner = ServiceRunner(_Echo(), ServiceConfig(
            name="expert-0", role=m.ServiceRole.EXPERT, endpoint=service_endpoint,
            supervisor_endpoint=supervisor_endpoint, heartbeat_interval_s=0.1, security=service_security))
        runner_task = asyncio.create_task(runner.run())
        clients = []
        try:
            ready = await supervisor.wait_ready(["expert-0"], timeout_s=10)  # Ready crossed a CURVE link
            assert ready["expert-0"].endpoint == service_endpoint
            friend = AsyncClient(service_endpoint, context=context, security=attention_security, default_timeout_s=5)
            router_client = AsyncClient(service_endpoint, context=context, security=router_security,
                                        default_timeout_s=5)
            foe = AsyncClient(service_endpoint, context=context, security=stranger_security, default_timeout_s=1)
            plain = AsyncClient(service_endpoint, context=context, default_timeout_s=1)
            clients = [friend, router_client, foe, plain]
            assert await friend.request(m.Ping(nonce=3)) == m.Pong(nonce=3, name="expert-0")
            assert await router_client.request(m.DraftRequest(step_id=9, slots=())) == m.DraftTokens(9, ())
            with pytest.raises(ReplyTimeout):
                await foe.request(m.Ping(nonce=4))
            with pytest.raises(ReplyTimeout):
                await plain.request(m.Ping(nonce=5))
            beats = supervisor.heartbeats["expert-0"].sequence
            await asyncio.sleep(0.4)
            assert supervisor.heartbeats["expert-0"].sequence > beats  # heartbeats keep flowing
        finally:
            runner.request_drain("test over")
            assert await asyncio.wait_for(runner_task, 10) == 0
            for client in clients:
                await client.close()
            supervisor_task.cancel()
            await asyncio.gather(supervisor_task, return_exceptions=True)
            supervisor.close()
            assert supervisor.authenticator is None
            context.term()

    asyncio.run(scenario())


def test_runner_without_keys_refuses_a_public_bind(tmp_path):
    """The bind policy applies through the runner: tcp beyond loopback without CURVE is refused."""
    runner = ServiceRunner(_Echo(), ServiceConfig(
        name="expert-0", role=m.ServiceRole.EXPERT, endpoint="tcp://0.0.0.0:0", supervisor_endpoint=None,
        security=SocketSecurity()))
    with pytest.raises(ValueError, match="CURVE"):
        asyncio.run(runner.run())
