"""Live placement changes, driven from the router (docs/design.md §6).

`PlacementAdmin.apply(placement, endpoints)` runs the one safe order:
1. load: every worker of the new placement loads the pairs it lacks (`LoadExperts`), and its
   `ExpertInventory` must then list all of them (else `PlacementApplyError`, nothing switched);
2. switch: every attention worker gets `SwitchPlacement`; each applies it between two of its
   steps, so no step mixes two tables and no request is dropped;
3. drop: every expert worker drops what it no longer serves (`DropExperts`); a worker absent
   from the new placement drops everything (scale in: it received no Dispatch after step 2).
Outputs do not change: the same experts compute the same pairs, only elsewhere; exactly so in
placement-invariant mode, to rounding otherwise (partial sums re-associate).
Clients are anything with `request(message, timeout_s=None)` (a `SyncClient`); the sequence
blocks, so the HTTP route runs it in a thread. Expert workers that registered with the router
(services/router/expert_registry.py) can be named without an endpoint; a worker of the applied
placement that restarts is reloaded with its pairs (`reload_worker`). This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from moemesh.common.placement.placement_file import Placement
from moemesh.common.wire.messages import (
    Ack, DropExperts, ExpertInventory, ExpertKey, LoadExperts, PlacementWorker, QueryInventory, SwitchPlacement,
)

log = structlog.get_logger("router")

Pair = tuple[int, int]  # (layer, expert)


class PlacementApplyError(RuntimeError):
    """A step of the sequence failed; the message says which step and which worker."""


@dataclass(frozen=True)
class PlacementAdminConfig:
    load_timeout_s: float = 600.0  # loading experts reads the checkpoint
    switch_timeout_s: float = 120.0  # waits for the attention worker's current step
    drop_timeout_s: float = 60.0


@dataclass(frozen=True)
class ApplyReport:
    placement_version: int
    num_loaded_by_worker: dict[str, int]
    num_dropped_by_worker: dict[str, int]

    def as_json(self) -> dict[str, Any]:
        return {"placement_version": self.placement_version, "loaded": self.num_loaded_by_worker,
                "dropped": self.num_dropped_by_worker}


def _keys(pairs: Sequence[Pair]) -> tuple[ExpertKey, ...]:
    return tuple(ExpertKey(layer=l, expert=e) for l, e in sorted(pairs))


def _held(inventory: Any, worker: str, step: str) -> set[Pair]:
    if not isinstance(inventory, ExpertInventory):
        raise PlacementApplyError(f"{step}: expert worker {worker} answered {type(inventory).__name__}: "
                                  f"{getattr(inventory, 'message', '')}")
    return {(k.layer, k.expert) for k in inventory.experts}


class PlacementAdmin:
    """expert_client(name, endpoint) -> a client of that expert worker (cached by the caller or
    not); attention_clients: one per attention worker."""

    def __init__(self, expert_client: Callable[[str, str], Any], attention_clients: Sequence[Any],
                 config: PlacementAdminConfig = PlacementAdminConfig()) -> None:
        self.expert_client = expert_client
        self.attention_clients = tuple(attention_clients)
        self.config = config
        self.placement_version = 0
        self.current_endpoints: dict[str, str] = {}  # name -> endpoint of the workers now serving
        self.current_placement: Placement | None = None  # the last placement applied (None: the deployment's)
        # called with every ExpertInventory a worker answers (the registry keeps its record fresh)
        self.inventory_listener: Callable[[ExpertInventory], None] | None = None
        self.is_gone: Callable[[str], bool] | None = None  # the registry's view: skip dead workers at drop
        # name -> pairs held under the deployment's own placement (before any apply): replica_cover's source
        self.deployment_holdings: dict[str, set[Pair]] = {}
        self._cover_cache: dict[tuple[int, str, frozenset[str]], bool] = {}

    def apply(self, placement: Placement, endpoints: Mapping[str, str],
              previous_endpoints: Mapping[str, str] | None = None) -> ApplyReport:
        """Load, switch, drop. `endpoints`: name -> endpoint of every worker in `placement`;
        `previous_endpoints`: workers serving before (default: those of the last apply)."""
        missing = [w.name for w in placement.workers if w.name not in endpoints]
        if missing:
            raise PlacementApplyError(f"no endpoint for expert workers {missing}")
        previous = dict(self.current_endpoints if previous_endpoints is None else previous_endpoints)
        version = self.placement_version + 1
        wanted = {w.name: set(w.expert_ids) | set(w.replica_ids) for w in placement.workers}
        loaded = self._load(version, placement, endpoints, wanted)
        self._switch(version, placement, endpoints)
        self.placement_version = version
        self.current_placement = placement
        self.current_endpoints = {w.name: endpoints[w.name] for w in placement.workers}
        dropped = self._drop(version, {**previous, **self.current_endpoints}, wanted)
        log.info("router.placement_applied", placement_version=version, workers=sorted(wanted),
                 num_loaded=sum(loaded.values()), num_dropped=sum(dropped.values()))
        return ApplyReport(version, loaded, dropped)

    def replica_cover(self, name: str, down: set[str]) -> bool:
        """True when workers other than `name` and not in `down` hold every pair `name` holds
        (in the applied placement, else the deployment's), so losing it costs no pair."""
        key = (self.placement_version, name, frozenset(down))
        if key not in self._cover_cache:
            if self.current_placement is not None:
                holdings = {w.name: set(w.expert_ids) | set(w.replica_ids) for w in self.current_placement.workers}
            else:
                holdings = self.deployment_holdings
            if name not in holdings:  # not in the applied placement: holds nothing; unknown: needed
                return self.current_placement is not None
            mine = holdings[name]
            others: set[Pair] = set()
            for other, pairs in holdings.items():
                if other != name and other not in down:
                    others |= pairs
            if len(self._cover_cache) > 256:
                self._cover_cache.clear()
            self._cover_cache[key] = mine <= others
        return self._cover_cache[key]

    def reload_worker(self, name: str, endpoint: str) -> int:
        """A worker of the applied placement came back (new process): load what it lacks of its
        pairs; returns how many. 0 when no placement was applied or it is not in it."""
        placement = self.current_placement
        if placement is None or name not in {w.name for w in placement.workers}:
            return 0
        worker = placement.worker(name)
        wanted = set(worker.expert_ids) | set(worker.replica_ids)
        client = self.expert_client(name, endpoint)
        lacking = sorted(wanted - self._held(client.request(QueryInventory(), timeout_s=self.config.drop_timeout_s),
                                             name, "reload"))
        if lacking:
            reply = client.request(LoadExperts(placement_version=self.placement_version, experts=_keys(lacking)),
                                   timeout_s=self.config.load_timeout_s)
            self._held(reply, name, "reload")
        log.info("router.expert_reloaded", name=name, num_loaded=len(lacking), placement_version=self.placement_version)
        return len(lacking)

    def _held(self, inventory: Any, worker: str, step: str) -> set[Pair]:
        held = _held(inventory, worker, step)
        if self.inventory_listener is not None:
            self.inventory_listener(inventory)
        return held

    def _load(self, version: int, placement: Placement, endpoints: Mapping[str, str],
              wanted: dict[str, set[Pair]]) -> dict[str, int]:
        loaded = {}
        for worker in placement.workers:
            client = self.expert_client(worker.name, endpoints[worker.name])
            held = self._held(client.request(QueryInventory(), timeout_s=self.config.drop_timeout_s), worker.name, "load")
            lacking = sorted(wanted[worker.name] - held)
            if lacking:
                reply = client.request(LoadExperts(placement_version=version, experts=_keys(lacking)),
                                       timeout_s=self.config.load_timeout_s)
                still = wanted[worker.name] - self._held(reply, worker.name, "load")
                if still:
                    raise PlacementApplyError(f"load: expert worker {worker.name} still lacks {len(still)} pairs, "
                                              f"first {min(still)}; placement not switched")
            loaded[worker.name] = len(lacking)
        return loaded

    def _switch(self, version: int, placement: Placement, endpoints: Mapping[str, str]) -> None:
        message = SwitchPlacement(placement_version=version, workers=tuple(
            PlacementWorker(name=w.name, endpoint=endpoints[w.name], experts=_keys(w.expert_ids),
                            replicas=_keys(w.replica_ids)) for w in placement.workers))
        for index, client in enumerate(self.attention_clients):
            reply = client.request(message, timeout_s=self.config.switch_timeout_s)
            if not isinstance(reply, Ack):
                raise PlacementApplyError(f"switch: attention worker {index} answered {type(reply).__name__}: "
                                          f"{getattr(reply, 'message', '')}")

    def _drop(self, version: int, endpoints: Mapping[str, str], wanted: dict[str, set[Pair]]) -> dict[str, int]:
        """After the switch nothing routes to what is dropped, so a worker that is gone (the
        registry says so, or it does not answer) is skipped: a dead process holds nothing."""
        from moemesh.common.wire.errors import ReplyTimeout

        dropped = {}
        for name, endpoint in sorted(endpoints.items()):
            if name not in wanted and self.is_gone is not None and self.is_gone(name):
                continue
            client = self.expert_client(name, endpoint)
            try:
                inventory = client.request(QueryInventory(), timeout_s=self.config.drop_timeout_s)
            except ReplyTimeout:
                if name in wanted:
                    raise
                log.warning("router.placement_drop_skipped", name=name, reason="no answer")
                continue
            extra = sorted(self._held(inventory, name, "drop") - wanted.get(name, set()))
            if extra:
                reply = client.request(DropExperts(placement_version=version, experts=_keys(extra)),
                                       timeout_s=self.config.drop_timeout_s)
                self._held(reply, name, "drop")
            dropped[name] = len(extra)
        return dropped


# ------------------------------------------------------------------ HTTP: /v1/admin/placement, /v1/admin/experts
def placement_route(admin: PlacementAdmin, known_endpoints: Mapping[str, str] | Callable[[], Mapping[str, str]],
                    registry: Any = None) -> Any:
    """The admin routes, mounted under `/v1/admin` (one route object for `build_app`):

    - `POST /v1/admin/placement`. Body: JSON {"placement_toml": TEXT, "endpoints": {name:
      endpoint}} (endpoints optional: merged over `known_endpoints`, the deployment's expert
      workers plus the registered ones; a callable is read at each request). Answers 200 with the
      ApplyReport, 400 for a bad placement, 409 when a step failed (the placement stays the old
      one when load failed), 423 while another apply runs;
    - `GET /v1/admin/experts`: the registered expert workers (registry snapshot) and the applied
      placement version (what `moemesh placement show --url` prints).
    The API key middleware guards both like every non-open path."""
    import asyncio

    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Mount, Route

    from moemesh.common.placement.placement_file import PlacementError, parse_toml
    from moemesh.common.wire.errors import ReplyTimeout

    lock = asyncio.Lock()

    def endpoints_now() -> dict[str, str]:
        return dict(known_endpoints() if callable(known_endpoints) else known_endpoints)

    async def apply_placement(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            placement = parse_toml(str(body["placement_toml"]), "request body")
            endpoints = {**endpoints_now(), **{str(k): str(v) for k, v in dict(body.get("endpoints") or {}).items()}}
        except (ValueError, KeyError, TypeError, PlacementError) as error:
            return JSONResponse({"error": {"message": f"bad placement request: {error}"[:500],
                                           "type": "invalid_request_error"}}, status_code=400)
        if lock.locked():
            return JSONResponse({"error": {"message": "a placement change is running", "type": "conflict"}},
                                status_code=423)
        async with lock:
            try:
                report = await asyncio.to_thread(admin.apply, placement, endpoints)
            except (PlacementApplyError, ReplyTimeout, OSError) as error:
                log.warning("router.placement_apply_failed", reason=str(error)[:300])
                return JSONResponse({"error": {"message": str(error)[:500], "type": "placement_error"}},
                                    status_code=409)
        return JSONResponse(report.as_json())

    async def list_experts(_: Request) -> JSONResponse:
        current = admin.current_placement
        return JSONResponse({
            "placement_version": admin.placement_version,
            "applied_workers": None if current is None else [w.name for w in current.workers],
            "workers": registry.snapshot() if registry is not None else [],
        })

    return Mount("/v1/admin", routes=[Route("/placement", apply_placement, methods=["POST"]),
                                      Route("/experts", list_experts, methods=["GET"])])
