"""Before anything is timed: every (layer, expert) is served by exactly the worker the plan says.

`verify_pairs_served` checks three things against the `SplitPlan`, in this order, and raises
`PairVerificationError` naming the first pair that breaks one of them:
1. every expert worker holds exactly its planned pairs (its `ExpertInventory`, asked over ZeroMQ:
   what the process really generated, so a worker that dropped experts under its start-up budget,
   rounded the budget differently, or read another placement shows up here);
2. the attention worker's dispatch tables send every pair to that worker: the `ReplicaRouter`'s
   holders (one holder per pair, none down) and the owner table on the attention device that the
   hot path indexes (`MoEDispatcher.owner`, read back);
3. no pair is held by two workers (the split plan has no replicas, so a second holder means the
   placement file and the plan disagree).
Why: without it a placement mismatch surfaces only after timing has started (`expert-near does not
hold layer 42 experts [76]`); with this check a placement mismatch fails at once, naming the pair, and a
failure that still happens afterwards is a data-plane problem, which `DispatchTrace` then shows.

`DispatchTrace` keeps the last Dispatches the attention side sent (ids and slot mask per worker;
one small device clone of the routing ids per layer, no host copy on the hot path); when an expert worker refuses a
Dispatch, `explain_refusals` puts what was sent next to what that worker says it received
(`bench.fullsize_expert` records the received ids and mask of every refused Dispatch).
Legend: L layers, E routed experts, T tokens, K top-k.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class PairVerificationError(RuntimeError):
    """A (layer, expert) pair is not served by exactly the worker the plan gives it."""


def planned_pairs(plan) -> dict[str, set[tuple[int, int]]]:
    """worker name -> the (layer, expert) pairs the split plan gives it."""
    return {w.name: {(int(l), int(e)) for l, e in w.expert_ids} for w in plan.placement.workers}


def query_inventories(endpoints: dict[str, str], timeout_s: float = 60.0) -> dict[str, set[tuple[int, int]]]:
    """worker name -> the pairs its ExpertInventory lists (asked on a fresh socket per worker)."""
    import zmq

    from moemesh.common.wire.messages import ErrorReply, ExpertInventory, QueryInventory
    from moemesh.common.wire.transport import SyncClient

    context = zmq.Context()
    held = {}
    try:
        for name, endpoint in endpoints.items():
            client = SyncClient(endpoint, context=context, accept=(ExpertInventory, ErrorReply),
                                default_timeout_s=timeout_s)
            try:
                reply = client.request(QueryInventory())
            finally:
                client.close()
            if not isinstance(reply, ExpertInventory):
                raise PairVerificationError(f"{name} ({endpoint}) answered the inventory query with {reply}")
            held[name] = {(key.layer, key.expert) for key in reply.experts}
    finally:
        context.term()
    return held


def check_pairs(planned: dict[str, set[tuple[int, int]]], held: dict[str, set[tuple[int, int]]],
                worker_names: list[str], router_holders: list[list[tuple[int, ...]]], down_workers: set[int],
                device_owner: list[list[int]], num_layers: int, num_experts: int) -> dict[str, Any]:
    """The checks of the module docstring on plain data; returns a summary or raises PairVerificationError.
    worker_names[i] is the worker behind channel index i of the attention worker."""
    for name in worker_names:
        missing = sorted(planned.get(name, set()) - held.get(name, set()))
        if missing:
            layer, expert = missing[0]
            raise PairVerificationError(
                f"pair (layer {layer}, expert {expert}) is planned on {name} but {name} does not hold it "
                f"({len(missing)} planned pairs missing there; it holds {len(held.get(name, ()))})")
    owners: dict[tuple[int, int], list[str]] = {}
    for name in worker_names:
        for pair in held.get(name, set()):
            owners.setdefault(pair, []).append(name)
    planned_owner = {pair: name for name, pairs in planned.items() for pair in pairs}
    if down_workers:
        raise PairVerificationError(f"the attention worker has expert workers marked down: "
                                    f"{[worker_names[w] for w in sorted(down_workers)]}")
    for layer in range(num_layers):
        for expert in range(num_experts):
            pair = (layer, expert)
            want = planned_owner.get(pair)
            if want is None:
                raise PairVerificationError(f"pair (layer {layer}, expert {expert}) is in no worker's plan")
            holders = [worker_names[w] for w in router_holders[layer][expert]]
            if holders != [want]:
                raise PairVerificationError(f"pair (layer {layer}, expert {expert}): the attention worker routes it "
                                            f"to {holders}, the plan to {want}")
            table_owner = worker_names[device_owner[layer][expert]]
            if table_owner != want:
                raise PairVerificationError(f"pair (layer {layer}, expert {expert}): the owner table on the "
                                            f"attention device says {table_owner}, the plan {want}")
            if owners.get(pair, []) != [want]:
                raise PairVerificationError(f"pair (layer {layer}, expert {expert}) is held by "
                                            f"{owners.get(pair, [])}, the plan gives it to {want} alone")
    extra = {name: len(held.get(name, set()) - planned.get(name, set())) for name in worker_names}
    return {"ok": True, "num_pairs": num_layers * num_experts,
            "num_held": {name: len(held.get(name, set())) for name in worker_names},
            "num_extra_held": extra}


def verify_pairs_served(dispatcher, plan, endpoints: dict[str, str], worker_names: list[str],
                        timeout_s: float = 60.0) -> dict[str, Any]:
    """Run every check against the live expert workers and the attention worker's `MoEDispatcher`
    (or a wrapper with `.inner`); worker_names[i] is behind the dispatcher's channel index i."""
    dispatcher = getattr(dispatcher, "inner", dispatcher)
    router = dispatcher.slot_owners.router
    dispatcher.slot_owners.refresh()  # the table the next dispatch indexes
    device_owner = dispatcher.slot_owners.owner.cpu().tolist()  # [L, E]
    held = query_inventories(endpoints, timeout_s)
    return check_pairs(planned_pairs(plan), held, worker_names, router.holders, set(router.down), device_owner,
                       router.num_layers, router.num_experts)


class DispatchTrace:
    """The last `max_tickets` MoE tickets with the routing ids they were built from (references only)."""

    def __init__(self, max_tickets: int = 128) -> None:
        self._tickets: deque = deque(maxlen=max_tickets)

    def add(self, step_id: int, layer: int, ids, ticket) -> None:
        """ids [T, K] is cloned (one small device copy): with decode graphs it is a static buffer that
        the next replay overwrites."""
        self._tickets.append((step_id, layer, ids.clone(), ticket))

    def sent(self, dispatch_id: int) -> dict[str, Any] | None:
        """What the attention side sent as `dispatch_id`: worker index, ids [T_w, K], mask [T_w, K]."""
        for step_id, layer, ids, ticket in self._tickets:
            for sent in getattr(ticket, "sent", ()):
                if sent.dispatch_id != dispatch_id:
                    continue
                rows = ids[sent.token_index]
                mask = sent.slot_mask
                return {"step_id": step_id, "layer": layer, "worker_index": sent.worker_index,
                        "expert_ids": rows.tolist(), "slot_mask": None if mask is None else mask.int().tolist()}
        return None


def explain_refusals(trace: DispatchTrace, expert_timings: dict[str, dict], worker_names: list[str],
                     planned: dict[str, set[tuple[int, int]]], max_items: int = 3) -> list[dict[str, Any]]:
    """For every refused Dispatch a worker recorded: what was sent, what arrived, and the verdict
    ("corrupted in transit" when they differ; "sent wrong" when the sent mask selects pairs the plan
    gives to another worker; "worker wrong" when what arrived is right for the plan)."""
    out = []
    for name, timing in expert_timings.items():
        for refused in timing.get("refused", [])[:max_items]:
            sent = trace.sent(refused["dispatch_id"])
            item = {"worker": name, "received": refused, "sent": sent}
            if sent is None:
                item["verdict"] = "not in the attention side's trace (older than its window)"
            elif worker_names[sent["worker_index"]] != name:
                item["verdict"] = f"sent to {worker_names[sent['worker_index']]}, arrived at {name}"
            elif (sent["expert_ids"], sent["slot_mask"]) != (refused["expert_ids"], refused["slot_mask"]):
                item["verdict"] = "corrupted in transit: the worker received other ids / mask than were sent"
            else:
                layer = sent["layer"]
                wrong = [e for row, mrow in zip(sent["expert_ids"], sent["slot_mask"] or [])
                         for e, m in zip(row, mrow) if m and (layer, e) not in planned.get(name, set())]
                item["verdict"] = (f"sent wrong: the mask selects experts {wrong} the plan gives elsewhere" if wrong
                                   else "worker wrong: it received what the plan gives it and refused")
            out.append(item)
    return out


__all__ = ["DispatchTrace", "PairVerificationError", "check_pairs", "explain_refusals", "planned_pairs",
           "query_inventories", "verify_pairs_served"]
