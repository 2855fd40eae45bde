"""Routing around a lost expert worker: mark it down, serve its pairs from live replicas, and take
it back once it answers again with its pairs loaded (docs/design.md §7).

`StepRecovery` (recovery.py) calls three things here:
- `mark_lost(worker_index) -> bool` after a dispatch to that worker failed: the worker leaves
  every pair's live holders (`ReplicaRouter.mark_down`); True when every pair still has a live
  holder, so the step can be retried at once on the replicas;
- `readmit() -> bool` while it waits for a restarted worker (no replica for some pair): asks
  every down worker for its inventory on a fresh socket; one that answers and holds every pair
  the placement gives it is marked up again. True once every pair is served;
- `readmit_due()` before each step: the same probe, at most every `readmit_interval_s` and
  only while a worker is down, so a worker restarted while replicas covered for it gets its
  share of the traffic back. A dead endpoint costs one `readmit_timeout_s` per interval.

A worker that answers but lacks pairs (restarted from a deployment whose placement is older
than the live one) stays down; the router's registry reloads it (services/router/expert_registry.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import structlog

from moemesh.common.wire.errors import ReplyTimeout, WireError
from moemesh.common.wire.messages import ErrorReply, ExpertInventory, QueryInventory

if TYPE_CHECKING:
    import zmq

    from moemesh.services.attention.moe_dispatch import MoEDispatcher

log = structlog.get_logger("attention")


class ExpertFailover:
    def __init__(self, dispatcher: MoEDispatcher, context: zmq.Context, security: Any, *,
                 probe_timeout_s: float = 0.5, readmit_timeout_s: float = 0.1, readmit_interval_s: float = 2.0) -> None:
        self.dispatcher = dispatcher
        self.context = context
        self.security = security
        self.probe_timeout_s = probe_timeout_s
        self.readmit_timeout_s = readmit_timeout_s
        self.readmit_interval_s = readmit_interval_s
        self._next_readmit_s = 0.0
        self.num_marked_down = 0
        self.num_readmitted = 0

    @property
    def router(self):
        return self.dispatcher.slot_owners.router

    def endpoint(self, worker_index: int) -> str:
        endpoints = self.dispatcher.channel.endpoints
        return endpoints[worker_index] if worker_index < len(endpoints) else f"<worker {worker_index}>"

    def mark_lost(self, worker_index: int) -> bool:
        served = self.router.mark_down(worker_index)
        self.num_marked_down += 1
        self._next_readmit_s = time.monotonic() + self.readmit_interval_s
        log.warning("attention.expert_marked_down", worker_index=worker_index, endpoint=self.endpoint(worker_index),
                    all_pairs_served=served, num_unserved_pairs=len(self.router.unserved),
                    down_workers=sorted(self.router.down))
        return served

    def readmit(self, timeout_s: float | None = None) -> bool:
        """Probe every down worker once; True when every pair has a live holder afterwards."""
        for worker_index in sorted(self.router.down):
            if not self.router.pairs_of(worker_index):  # a placement switch took everything from it
                self.router.mark_up(worker_index)
                continue
            if self._holds_its_pairs(worker_index, self.probe_timeout_s if timeout_s is None else timeout_s):
                self.router.mark_up(worker_index)
                if worker_index < len(self.dispatcher.num_slot_tokens_in_flight):
                    self.dispatcher.num_slot_tokens_in_flight[worker_index] = 0  # its old tickets were forgotten
                self.num_readmitted += 1
                log.info("attention.expert_readmitted", worker_index=worker_index,
                         endpoint=self.endpoint(worker_index), down_workers=sorted(self.router.down))
        return self.router.all_served

    def all_answer(self) -> bool:
        """Every worker of the tables answers with its pairs (used when a loss named no worker)."""
        return all(self._holds_its_pairs(w, self.probe_timeout_s) for w in range(self.router.num_workers)
                   if self.router.pairs_of(w))

    def readmit_due(self) -> None:
        """Before a step: probe down workers now and then (see the module docstring)."""
        if not self.router.down or time.monotonic() < self._next_readmit_s:
            return
        self.readmit(self.readmit_timeout_s)
        self._next_readmit_s = time.monotonic() + self.readmit_interval_s

    def _holds_its_pairs(self, worker_index: int, timeout_s: float) -> bool:
        from moemesh.common.wire.transport import SyncClient

        if worker_index >= len(self.dispatcher.channel.endpoints):
            return False
        if worker_index == self.dispatcher.local_index:  # this process's own experts: always held
            return True
        client = SyncClient(self.endpoint(worker_index), context=self.context, accept=(ExpertInventory, ErrorReply),
                            default_timeout_s=timeout_s, security=self.security)
        try:
            reply = client.request(QueryInventory())
        except (ReplyTimeout, WireError):
            return False
        finally:
            client.close()
        if not isinstance(reply, ExpertInventory):
            return False  # e.g. DRAINING: the old process is still on its way out
        held = {(key.layer, key.expert) for key in reply.experts}
        lacking = [pair for pair in self.router.pairs_of(worker_index) if pair not in held]
        if lacking:
            log.warning("attention.expert_lacks_pairs", worker_index=worker_index, endpoint=self.endpoint(worker_index),
                        num_lacking=len(lacking), first=list(lacking[0]))
            return False
        return True
