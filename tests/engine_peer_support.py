"""The router's Engine against a fake attention worker in one event loop, for engine tests without processes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq.asyncio

from moemesh.services.router.engine import Engine
from moemesh.services.router.engine_config import EngineConfig
from moemesh.services.router.scheduler import Scheduler, SchedulerConfig


def run_engine_against_peer(tmp_path: Path, make_peer: Callable[[str, zmq.asyncio.Context], Any],
                            make_engine_config: Callable[[str], EngineConfig], scheduler: SchedulerConfig,
                            scenario: Callable[[Engine, Any], Awaitable[Any]], timeout_s: float,
                            **engine_options) -> Any:
    """scenario(engine, peer) with the peer (make_peer(endpoint, context): serves StepPlans from `run()`, holds
    its `server`) on an ipc endpoint and a started Engine(make_engine_config(endpoint), Scheduler(scheduler));
    everything is stopped and closed afterwards, the scenario's result returned."""

    async def main():
        context = zmq.asyncio.Context()
        endpoint = f"ipc://{tmp_path}/attention.sock"
        peer = make_peer(endpoint, context)
        peer_task = asyncio.create_task(peer.run())
        engine = Engine(make_engine_config(endpoint), Scheduler(scheduler), context=context, **engine_options)
        await engine.start()
        try:
            return await asyncio.wait_for(scenario(engine, peer), timeout=timeout_s)
        finally:
            await engine.stop()
            peer_task.cancel()
            await asyncio.gather(peer_task, return_exceptions=True)
            peer.server.close()
            context.term()

    return asyncio.run(main())
