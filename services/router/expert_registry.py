"""The router's record of the expert workers that announced themselves.

An expert worker that starts, listed in the deployment or not (`moemesh expert --config FILE
--set expert[N].name=NAME --set expert[N].placement=none` joins a running deployment), sends
`Ready` (name, role, pid, endpoint, device) to the router's supervisor endpoint once it has
loaded. The registry sees each new expert Ready (or a new pid: a restart), asks the worker for
its `ExpertInventory` over the admin channel (what it holds, weight bytes, the routed-expert
bytes its startup budget has left) and records it. From then on:
- `moemesh placement apply` / `POST /v1/admin/placement` can name the worker without an
  `--endpoint`: the route merges `endpoints()` into the deployment's endpoints;
- `/status.json` (placement per worker) and `GET /v1/admin/experts` (`moemesh placement show
  --url`) list it with its device, pid, state, experts and free budget;
- a worker that restarts while a placement applied through the router gives it pairs is
  reloaded at once (`on_restart`: LoadExperts of what it lacks), so the attention worker's
  readmission probe finds it complete;
- a worker whose last heartbeat said STOPPED, or that stayed silent beyond `max_silence_s`, is
  marked `gone` (it stays listed, so the operator sees it left).
The registry only reads the supervisor's records; its blocking queries run in a thread.
Imports no torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from moemesh.common.wire.messages import ExpertInventory, ServiceRole, ServiceState

log = structlog.get_logger("router")


@dataclass
class RegisteredExpert:
    name: str
    endpoint: str
    device: str
    pid: int
    state: str = "ready"  # ready | gone | unreachable (announced, but its inventory query failed)
    placement_version: int = 0
    num_experts: int = 0
    num_weight_bytes: int = 0
    free_budget_bytes: int | None = None
    experts_by_layer: dict[int, list[int]] = field(default_factory=dict)
    registered_unix_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["experts_by_layer"] = {str(layer): experts for layer, experts in self.experts_by_layer.items()}
        return data


class ExpertRegistry:
    """supervisor: the router's Supervisor (ready, heartbeats, last_seen_s);
    query(name, endpoint) -> ExpertInventory or anything else on failure (blocking);
    on_restart(name, endpoint): called (blocking) after a known worker came back with a new pid."""

    def __init__(self, supervisor: Any, query: Callable[[str, str], Any], *, max_silence_s: float = 5.0,
                 on_restart: Callable[[str, str], Any] | None = None, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.supervisor = supervisor
        self.query = query
        self.max_silence_s = max_silence_s
        self.on_restart = on_restart
        self.clock = clock
        self.workers: dict[str, RegisteredExpert] = {}
        # a {worker: {layer: experts}} dict kept equal to placement_view() in place (the status
        # page's placement: StatusSources holds this very dict); None: none bound
        self.view: dict[str, dict[int, list[int]]] | None = None

    async def run(self, interval_s: float = 0.5) -> None:
        """Refresh until cancelled."""
        while True:
            try:
                await self.refresh()
            except Exception:  # display and convenience only: never take the router down
                log.exception("router.expert_registry_failed")
            await asyncio.sleep(interval_s)

    async def refresh(self) -> None:
        for name, ready in list(self.supervisor.ready.items()):
            if ready.role is not ServiceRole.EXPERT:
                continue
            known = self.workers.get(name)
            if known is not None and known.pid == ready.pid and known.state != "unreachable":
                continue
            reply = await asyncio.to_thread(self.query, name, ready.endpoint)
            worker = RegisteredExpert(name, ready.endpoint, ready.device, ready.pid,
                                      registered_unix_s=time.time())
            self.workers[name] = worker
            if not isinstance(reply, ExpertInventory):
                worker.state = "unreachable"
                log.warning("router.expert_unreachable", name=name, endpoint=ready.endpoint,
                            reply=type(reply).__name__)
                continue
            self.note_inventory(reply)
            log.info("router.expert_registered", name=name, endpoint=ready.endpoint, device=ready.device,
                     pid=ready.pid, num_experts=worker.num_experts, free_budget_bytes=worker.free_budget_bytes,
                     restarted=known is not None)
            if known is not None and self.on_restart is not None:
                await asyncio.to_thread(self.on_restart, name, ready.endpoint)
        self._mark_gone()
        self._update_view()

    def _mark_gone(self) -> None:
        now_s = self.clock()
        for name, worker in self.workers.items():
            beat = self.supervisor.heartbeats.get(name)
            seen_s = self.supervisor.last_seen_s.get(name)
            stopped = beat is not None and beat.state is ServiceState.STOPPED and name not in self.supervisor.ready
            silent = seen_s is not None and now_s - seen_s > self.max_silence_s
            if worker.state == "gone" and not (stopped or silent):
                worker.state = "ready"  # it beats again (it was only slow)
                log.info("router.expert_back", name=name, endpoint=worker.endpoint)
            elif worker.state != "gone" and (stopped or silent):
                worker.state = "gone"
                log.warning("router.expert_gone", name=name, endpoint=worker.endpoint,
                            reason="stopped" if stopped else f"silent for {now_s - seen_s:.1f}s")

    def note_inventory(self, inventory: ExpertInventory) -> None:
        """Update a worker's record from an inventory it sent (registration, load, drop)."""
        worker = self.workers.get(inventory.name)
        if worker is None:
            return
        by_layer: dict[int, list[int]] = {}
        for key in inventory.experts:
            by_layer.setdefault(key.layer, []).append(key.expert)
        worker.state = "ready"
        worker.placement_version = inventory.placement_version
        worker.num_experts = len(inventory.experts)
        worker.num_weight_bytes = inventory.num_weight_bytes
        worker.free_budget_bytes = inventory.free_budget_bytes
        worker.experts_by_layer = {layer: sorted(experts) for layer, experts in sorted(by_layer.items())}
        self._update_view()

    def bind_view(self, view: dict[str, dict[int, list[int]]]) -> None:
        """Keep `view` (e.g. the deployment's placement, shown on the status page) up to date:
        registered workers replace their entries, gone ones leave it."""
        self.view = view
        self._update_view()

    def _update_view(self) -> None:
        if self.view is None:
            return
        for name, worker in self.workers.items():
            if worker.state == "gone":
                self.view.pop(name, None)
            elif worker.state == "ready":
                self.view[name] = dict(worker.experts_by_layer)

    def endpoints(self) -> dict[str, str]:
        """name -> endpoint of every worker not gone (what `placement apply` may name)."""
        return {name: w.endpoint for name, w in self.workers.items() if w.state != "gone"}

    def placement_view(self) -> dict[str, dict[int, list[int]]]:
        """{worker: {layer: experts}} of the workers not gone (the status page's placement)."""
        return {name: dict(w.experts_by_layer) for name, w in sorted(self.workers.items()) if w.state != "gone"}

    def snapshot(self) -> list[dict[str, Any]]:
        return [worker.as_json() for _, worker in sorted(self.workers.items())]
