"""The CUDA IPC side of `MoEDispatcher`: Dispatches whose tensors travel in shared device rings.

With `data_plane = "cuda_ipc"` the dispatcher offers each expert worker, the first time it sends
to it, a `DispatchRing` (common/wire/cuda_ipc.py: layout and why reuse is safe; cuda_ipc_rings.py:
the two ways the streams are ordered). A worker that maps it gets `DispatchSlot` control messages
from then on; one that refuses (another host, a CPU device, a mapping error) is remembered and stays
on ZeroMQ (`attention.data_plane_fallback` is logged once per worker). A Dispatch also goes over
ZeroMQ when it has more rows than a slot or when every slot of that worker is in flight (counted in
`num_zmq_fallbacks`).

Deferred confirmation (flags): the attention stream waits for the expert's combine flag on the
device, so `finish` returns the output view without waiting for the CombineSlot reply. The reply is
*confirmed* later: before the slot is used again, before any host sync of the dispatcher, and at
the end of the step (`confirm_all`). A confirmation that finds an error or times out unblocks the
streams still waiting on that worker's flags (their step is discarded), forgets its ring and
raises the dispatcher's `ExpertWorkerLost` (built by `on_lost`), exactly as an undeferred failure.
With events every reply is received in `finish`, as on ZeroMQ.

Whole-layer fast path (`MoEDispatcher._start_whole`): when one worker holds every expert of a layer,
the micro-batch goes to it whole, with no slot mask and no host sync; otherwise the split costs one
host sync per layer (the routing read-back of `MoEDispatcher.start`). The expert computes exactly the rows
the ZeroMQ path sends it (all of them, every slot its own), so outputs are identical.
Legend: T tokens, K top-k, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from moemesh.common.wire import tensors
from moemesh.common.wire.cuda_ipc import CudaIpcConfig, RingLayout, RingSync
from moemesh.common.wire.cuda_ipc_rings import DispatchRing
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.messages import CombineSlot, DispatchSlot, ErrorReply

log = structlog.get_logger("attention")


@dataclass(frozen=True)
class _Unconfirmed:
    ticket: int
    dispatch_id: int
    layer: int
    num_tokens: int


class SlotPlane:
    def __init__(self, channel: Any, config: CudaIpcConfig, device: torch.device, *, placement_invariant: bool,
                 on_lost: Callable[[int, str], Exception] | None = None, channel_prefix: str = "attention") -> None:
        self.channel = channel
        self.config = config
        self.device = torch.device(device)
        self.placement_invariant = placement_invariant
        self.on_lost = on_lost or (lambda worker_index, cause: RuntimeError(f"expert worker {worker_index}: {cause}"))
        self.channel_prefix = channel_prefix
        self._rings: dict[int, DispatchRing | None] = {}  # worker index -> attached ring, or None: ZeroMQ
        self._unconfirmed: dict[tuple[int, int], _Unconfirmed] = {}  # (worker, slot) -> reply not yet received
        self.num_slot_dispatches = 0
        self.num_zmq_fallbacks = 0

    # ----------------------------------------------------------------------------- rings
    def ring_for(self, worker_index: int, x: torch.Tensor, top_k: int) -> DispatchRing | None:
        """The worker's attached ring (attaching on first use), or None when it stays on ZeroMQ."""
        if worker_index in self._rings:
            return self._rings[worker_index]
        ring = None
        if self.device.type != "cuda":
            log.warning("attention.data_plane_fallback", endpoint=self.channel.endpoints[worker_index],
                        data_plane="zmq", reason=f"attention device {self.device} is not CUDA")
        else:
            layout = RingLayout(num_slots=self.config.num_slots, max_tokens=self.config.max_tokens,
                                hidden_size=x.shape[1], top_k=top_k, hidden_dtype=tensors.dtype_name(x.dtype),
                                per_expert_outputs=self.placement_invariant)
            try:
                candidate = DispatchRing(f"{self.channel_prefix}/{id(self):x}/{worker_index}", self.device, layout,
                                         RingSync(self.config.sync))
                if self.channel.attach_cuda_ipc(worker_index, candidate, timeout_s=self.config.attach_timeout_s):
                    ring = candidate
            except (RuntimeError, ValueError, OSError) as error:  # torch raises RuntimeError for CUDA IPC errors
                log.warning("attention.data_plane_fallback", endpoint=self.channel.endpoints[worker_index],
                            data_plane="zmq", reason=f"{type(error).__name__}: {error}"[:300])
        self._rings[worker_index] = ring
        return ring

    def defers(self, worker_index: int) -> bool:
        """Whether `finish` may skip waiting for this worker's replies (flags ordering)."""
        ring = self._rings.get(worker_index)
        return ring is not None and ring.sync is RingSync.FLAGS

    def forget(self, worker_index: int) -> None:
        """Drop a worker's ring (it failed or restarted); the next send offers a new one."""
        ring = self._rings.pop(worker_index, None)
        for key in [key for key in self._unconfirmed if key[0] == worker_index]:
            del self._unconfirmed[key]
            if ring is not None:
                ring.unblock(key[1])

    def reset(self) -> None:
        """Recovery dropped every in-flight ticket: unblock all waits, forget every ring."""
        for worker_index in list(self._rings):
            self.forget(worker_index)

    # ----------------------------------------------------------------------------- send / answer
    def try_send(self, worker_index: int, *, dispatch_id: int, step_id: int, layer: int, micro_batch: int,
                 x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 slot_mask: torch.Tensor | None) -> tuple[int, int] | None:
        """x [T, D], ids [T, K], weights [T, K], slot_mask [T, K] or None -> (ticket, slot), or None
        when this Dispatch must go over ZeroMQ (no ring, too many rows, no free slot)."""
        ring = self.ring_for(worker_index, x, ids.shape[1])
        if ring is None:
            return None
        if not ring.fits(x.shape[0]) or ring.peek_free() is None:
            self.num_zmq_fallbacks += 1
            return None
        self.confirm(worker_index, ring.peek_free())  # the slot's previous use answered well (flags)
        ring = self._rings.get(worker_index)
        if ring is None:  # pragma: no cover - confirm raises when it forgets a ring
            return None
        slot = ring.acquire()
        sequence = ring.write(slot, x, ids, weights, slot_mask)
        message = DispatchSlot(dispatch_id=dispatch_id, step_id=step_id, layer=layer, micro_batch=micro_batch,
                               channel_id=ring.channel_id, slot=slot, num_tokens=x.shape[0],
                               per_expert_outputs=self.placement_invariant, has_slot_mask=slot_mask is not None,
                               sequence=sequence)
        try:
            ticket = self.channel.send(worker_index, message)
        except BaseException:
            ring.unblock(slot)
            ring.release(slot)
            raise
        self.num_slot_dispatches += 1
        return ticket, slot

    def deferred_output(self, worker_index: int, slot: int, ticket: int, *, dispatch_id: int, layer: int,
                        num_tokens: int) -> torch.Tensor:
        """Flags: the output view, ordered on the device after the expert's combine flag; the reply
        is confirmed later (`confirm`)."""
        self._unconfirmed[(worker_index, slot)] = _Unconfirmed(ticket, dispatch_id, layer, num_tokens)
        return self._rings[worker_index].output(slot, num_tokens)

    def output(self, worker_index: int, slot: int, reply: Any, *, dispatch_id: int, layer: int,
               num_tokens: int) -> torch.Tensor | str:
        """Events: the device view of a received CombineSlot's output (ordered after the expert's
        event), or why the reply does not match the DispatchSlot (the caller raises)."""
        problem = _mismatch(reply, slot, dispatch_id, layer, num_tokens)
        if problem is not None:
            return problem
        ring = self._rings.get(worker_index)
        if ring is None:
            return "combine slot for a channel without a ring"
        return ring.output(slot, num_tokens)

    def confirm(self, worker_index: int, slot: int | None) -> None:
        """Receive the deferred reply of (worker, slot), if any; raise `on_lost(...)` when it failed."""
        pending = self._unconfirmed.pop((worker_index, slot), None)
        if pending is None:
            return
        try:
            reply = self.channel.receive(worker_index, pending.ticket)
            problem = (f"{reply.code}: {reply.message}" if isinstance(reply, ErrorReply)
                       else _mismatch(reply, slot, pending.dispatch_id, pending.layer, pending.num_tokens))
        except ReplyTimeout as error:
            problem = str(error)
        if problem is not None:
            ring = self._rings.get(worker_index)
            if ring is not None:
                ring.unblock(slot)
            self.forget(worker_index)
            raise self.on_lost(worker_index, f"layer {pending.layer}: {problem}")

    def confirm_all(self) -> None:
        """Confirm every deferred reply (end of a step, or before a host sync that could otherwise
        wait forever behind a flag that a dead worker never writes)."""
        for worker_index, slot in sorted(self._unconfirmed, key=lambda key: self._unconfirmed[key].ticket):
            self.confirm(worker_index, slot)  # oldest first: a failure names the first dispatch that failed

    @property
    def num_unconfirmed(self) -> int:
        return len(self._unconfirmed)

    def release(self, worker_index: int, slot: int) -> None:
        """The slot's output was consumed (its reads are queued on the stream): reusable."""
        ring = self._rings.get(worker_index)
        if ring is not None:
            ring.release(slot)


def _mismatch(reply: Any, slot: int, dispatch_id: int, layer: int, num_tokens: int) -> str | None:
    if not isinstance(reply, CombineSlot) or reply.dispatch_id != dispatch_id or reply.layer != layer:
        return (f"answered dispatch slot {dispatch_id} with {type(reply).__name__} "
                f"{getattr(reply, 'dispatch_id', None)}")
    if reply.slot != slot or reply.num_tokens != num_tokens:
        return f"combine slot {reply.slot} / {reply.num_tokens} tokens, expected {slot} / {num_tokens}"
    return None
