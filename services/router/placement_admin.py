"""Live placement changes, driven from the router (issue 8 part 4; architecture.md §6).

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
blocks, so the HTTP route runs it in a thread. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from common.placement.placement_file import Placement
from common.wire.messages import (
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
        self.current_endpoints = {w.name: endpoints[w.name] for w in placement.workers}
        dropped = self._drop(version, {**previous, **self.current_endpoints}, wanted)
        log.info("router.placement_applied", placement_version=version, workers=sorted(wanted),
                 num_loaded=sum(loaded.values()), num_dropped=sum(dropped.values()))
        return ApplyReport(version, loaded, dropped)

    def _load(self, version: int, placement: Placement, endpoints: Mapping[str, str],
              wanted: dict[str, set[Pair]]) -> dict[str, int]:
        loaded = {}
        for worker in placement.workers:
            client = self.expert_client(worker.name, endpoints[worker.name])
            held = _held(client.request(QueryInventory(), timeout_s=self.config.drop_timeout_s), worker.name, "load")
            lacking = sorted(wanted[worker.name] - held)
            if lacking:
                reply = client.request(LoadExperts(placement_version=version, experts=_keys(lacking)),
                                       timeout_s=self.config.load_timeout_s)
                still = wanted[worker.name] - _held(reply, worker.name, "load")
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
        dropped = {}
        for name, endpoint in sorted(endpoints.items()):
            client = self.expert_client(name, endpoint)
            extra = sorted(_held(client.request(QueryInventory(), timeout_s=self.config.drop_timeout_s), name, "drop")
                           - wanted.get(name, set()))
            if extra:
                reply = client.request(DropExperts(placement_version=version, experts=_keys(extra)),
                                       timeout_s=self.config.drop_timeout_s)
                _held(reply, name, "drop")
            dropped[name] = len(extra)
        return dropped


# ------------------------------------------------------------------ HTTP: POST /v1/admin/placement
def placement_route(admin: PlacementAdmin, known_endpoints: Mapping[str, str]) -> Any:
    """The `POST /v1/admin/placement` route. Body: JSON {"placement_toml": TEXT, "endpoints":
    {name: endpoint}} (endpoints optional: merged over `known_endpoints`, the deployment's expert
    workers). Answers 200 with the ApplyReport, 400 for a bad placement, 409 when a step failed
    (the placement stays the old one when load failed), 423 while another apply runs. The API key
    middleware guards it like every non-open path."""
    import asyncio

    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from common.placement.placement_file import PlacementError, parse_toml
    from common.wire.errors import ReplyTimeout

    lock = asyncio.Lock()

    async def apply_placement(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            placement = parse_toml(str(body["placement_toml"]), "request body")
            endpoints = {**known_endpoints, **{str(k): str(v) for k, v in dict(body.get("endpoints") or {}).items()}}
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

    return Route("/v1/admin/placement", apply_placement, methods=["POST"])
