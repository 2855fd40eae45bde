"""Live placement changes on the attention worker: `SwitchPlacement` applied between two steps.

The router's sequence (services.router.placement_admin) guarantees every worker of the new
placement already holds its pairs when this message arrives, so the switch itself is cheap:
- endpoints not yet known are connected on the fly (a DEALER socket appended to the channel;
  sockets of workers that left stay open, idle, so indices already issued stay valid);
- every pair's holders (channel indices, primary first) are swapped in with
  `MoEDispatcher.set_holders`; replicas then share a pair's load (replica_routing.py), and
  workers marked down after a failure stay down until they answer again.
The worker's service loop handles one message at a time and a StepPlan runs to completion
inside one `handle`, so a switch can only land between two steps: no Dispatch is in flight.
A placement that leaves a pair without owner is refused (ErrorReply) and the old one stays.
Legend: L layers, E routed experts, R owner tables (replica turns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import zmq

from moemesh.common.placement.placement_file import PlacementError
from moemesh.common.wire.messages import Ack, ErrorCode, ErrorReply, SwitchPlacement
from moemesh.common.placement.worker_holdings import WorkerHoldings

log = structlog.get_logger("attention")


def replica_owner_tables(workers: Sequence[WorkerHoldings], num_layers: int, num_experts: int
                         ) -> list[list[list[int]]]:
    """R tables [L, E] of indices into `workers`. A pair's holders are its primary holders (in
    worker order), then its replica holders; table r gives holders[r mod len(holders)], so a
    dispatcher that takes the tables in turn spreads each pair's load over its copies (round
    robin). Table 0 equals `owner_table`. PlacementError when a pair has no holder."""
    holders: list[list[list[int]]] = [[[] for _ in range(num_experts)] for _ in range(num_layers)]
    for copies in ("primary", "replicas"):
        for index, worker in enumerate(workers):
            for layer, expert in getattr(worker, copies):
                if not (0 <= layer < num_layers and 0 <= expert < num_experts):
                    raise PlacementError(f"{worker.name}: pair ({layer}, {expert}) is outside the model")
                if index not in holders[layer][expert]:
                    holders[layer][expert].append(index)
    missing = [(l, e) for l in range(num_layers) for e in range(num_experts) if not holders[l][e]]
    if missing:
        raise PlacementError(f"{len(missing)} (layer, expert) pairs are held by no worker, first {missing[0]}")
    num_tables = max(len(h) for row in holders for h in row)
    return [[[h[turn % len(h)] for h in row] for row in holders] for turn in range(num_tables)]


def pair_holders(workers: Sequence[WorkerHoldings], num_layers: int, num_experts: int
                 ) -> list[list[tuple[int, ...]]]:
    """[L][E] -> indices into `workers` holding the pair: primary holders first (worker order),
    then replica holders. PlacementError when a pair has no holder."""
    tables = replica_owner_tables(workers, num_layers, num_experts)
    return [[tuple(dict.fromkeys(table[layer][expert] for table in tables)) for expert in range(num_experts)]
            for layer in range(num_layers)]


def connect_endpoint(channel: Any, endpoint: str, context: zmq.Context, security: Any = None) -> int:
    """The channel index of `endpoint`, connecting a new DEALER socket when it is not known yet."""
    if endpoint in channel.endpoints:
        return channel.endpoints.index(endpoint)
    socket = context.socket(zmq.DEALER)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        if security is not None:
            security.secure_client(socket, endpoint)
        socket.connect(endpoint)
    except BaseException:
        socket.close(linger=0)
        raise
    channel.sockets.append(socket)  # the channel's finalizer closes this same list
    channel.endpoints = (*channel.endpoints, endpoint)
    return len(channel.sockets) - 1


def apply_switch(worker: Any, message: SwitchPlacement) -> Ack | ErrorReply:
    """Swap `worker.dispatcher`'s tables to `message`'s placement (an AttentionWorker, loaded)."""
    current = getattr(worker, "placement_version", 0)
    if message.placement_version <= current:
        return ErrorReply(code=ErrorCode.MALFORMED,
                          message=f"placement version {message.placement_version} is not newer than {current}")
    config = worker.side.config
    holdings = [WorkerHoldings(entry.name, tuple((k.layer, k.expert) for k in entry.experts),
                               tuple((k.layer, k.expert) for k in entry.replicas)) for entry in message.workers]
    try:
        holders = pair_holders(holdings, config.num_hidden_layers, config.n_routed_experts)
    except PlacementError as error:
        return ErrorReply(code=ErrorCode.UNEXPECTED, message=f"placement {message.placement_version}: {error}")
    indices = [connect_endpoint(worker.channel, entry.endpoint, worker._zmq_context, worker.config.security)
               for entry in message.workers]
    worker.dispatcher.slot_owners.set_holders([[tuple(indices[w] for w in copies) for copies in row]
                                               for row in holders])
    worker.placement_version = message.placement_version
    log.info("attention.placement_switched", placement_version=message.placement_version,
             workers=[w.name for w in message.workers], max_copies=max(len(c) for row in holders for c in row),
             replica_policy=str(worker.dispatcher.slot_owners.replica_policy),
             num_sockets=len(worker.channel.sockets), down_workers=sorted(worker.dispatcher.slot_owners.router.down))
    return Ack(detail=f"placement {message.placement_version}")
