"""The router engine's side of the start-time warm-up (warm_up.py runs it): synthetic requests in, the step
timeout while it runs, and forgetting it afterwards. `Engine` (engine.py) inherits it.

`EngineWarmUp` keeps no state of its own: it works on the engine's (`config`, `scheduler`,
`serving_scheduler_config`, `translator`,
`health_tracker`, `drafts`, `warm_up`, `_client`, `_new_requests`, the step counters, `routing_summary`),
all set by `Engine.__init__`, and on its `_open_stream`. Imports no torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import structlog

from moemesh.common.wire.errors import ReplyTimeout, WireError
from moemesh.common.wire.messages import EndWarmUp, WarmUpEnded
from moemesh.services.router.engine_client import GenerationRequest
from moemesh.services.router.scheduler import Scheduler
from moemesh.services.router.step_totals import DecodeStepTotals

log = structlog.get_logger("router")


def warm_up_scheduler(scheduler: Scheduler) -> Scheduler:
    """The scheduler the warm-up runs with: the serving one, but prompts always in their usual chunks (no
    graph-sized short prefills), so the warm-up's step-token waves reach the eager step sizes a busy server
    computes a short prompt in; `end_warm_up` then starts the serving config's scheduler."""
    if not scheduler.config.graph_chunk_tokens:
        return scheduler
    return Scheduler(dataclasses.replace(scheduler.config, graph_chunk_tokens=0), scheduler.clock)


class EngineWarmUp:
    """The warm-up hooks of `Engine` (see the module docstring)."""

    def submit_warm_up(self, request: GenerationRequest) -> AsyncIterator:
        """A synthetic request of the start-time warm-up: as `submit`, without waiting for the health the
        warm-up itself holds back."""
        return self._open_stream(request)

    def workers_ready(self) -> bool:
        """Every needed worker ready and beating, and the drafter up or known down: the warm-up starts then."""
        if not self.health_tracker.report().ok:
            return False
        return self.drafts is None or not self.drafts.status().startswith("starting")

    async def end_warm_up(self) -> WarmUpEnded | None:
        """After the warm-up's last request: once nothing runs (the synthetic requests' slots freed on the
        worker, at most a warm-up step timeout), EndWarmUp to the attention worker (it drops their routing
        counts), then forget them: a fresh scheduler of the same config (no prefix keys, counters or
        throughput), zeroed step counters, the drafts' measurements. The attention worker's report, or None."""
        deadline_s = time.monotonic() + self.warm_up.step_timeout_s
        while not self._idle() and time.monotonic() < deadline_s:
            await asyncio.sleep(self.config.recovery_poll_s)
        ended = None
        try:
            reply = await self._client.request(EndWarmUp(), timeout_s=self.warm_up.step_timeout_s)
            if isinstance(reply, WarmUpEnded):
                ended = reply
            else:
                log.warning("router.warm_up_end_refused", reply=type(reply).TYPE)
        except (ReplyTimeout, WireError) as error:
            log.warning("router.warm_up_end_failed", error=str(error)[:200])
        self.scheduler = Scheduler(self.serving_scheduler_config, self.scheduler.clock)
        self.num_steps = self.num_failed_steps = 0
        self.step_seconds_total = 0.0
        self.decode_step_totals = DecodeStepTotals()
        self.routing_summary = None
        if self.drafts is not None:
            self.drafts.forget_measurements()
        return ended

    def _idle(self) -> bool:
        """Nothing queued, scheduled or in flight, and no slot left for the worker to free."""
        return (not self._new_requests and not self.scheduler.num_unfinished_requests
                and self.translator.num_slots_held == 0 and self.health_tracker.step_started_s is None)

    def _step_timeout_s(self) -> float:
        """The warm-up's while it runs (first compiles and captures), else `step_timeout_s`."""
        if self.warm_up is not None and self.warm_up.running:
            return self.warm_up.step_timeout_s
        return self.config.step_timeout_s

