"""The expert worker's end of the CUDA IPC data plane (common/wire/cuda_ipc.py).

`attach(AttachCudaIpc) -> CudaIpcAttached`: map the attention worker's rings when the peer is on
this host and this worker is on CUDA, else refuse with the reason (the sender stays on ZeroMQ).
`inputs(DispatchSlot)`: the slot's tensors as device views, ordered after the sender's signal (a
flag or an event: common/wire/cuda_ipc_rings.py; the stream waits, the host does not).
`reply(DispatchSlot, output) -> CombineSlot`: the output copied into the combine slot, then the
combine signal, then the control reply.
Legend: T tokens, K top-k, D hidden.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from moemesh.common.wire.cuda_ipc import host_identity
from moemesh.common.wire.cuda_ipc_rings import AttachedRing
from moemesh.common.wire.messages import AttachCudaIpc, CombineSlot, CudaIpcAttached, DispatchSlot, ErrorCode, ErrorReply

log = structlog.get_logger("expert")


class ExpertSlotPlane:
    def __init__(self, device: torch.device, name: str = "expert") -> None:
        self.device = torch.device(device)
        self.name = name
        self._rings: dict[str, AttachedRing] = {}  # channel id -> mapped rings
        self.num_slot_dispatches = 0

    def attach(self, message: AttachCudaIpc) -> CudaIpcAttached:
        reason = None
        if self.device.type != "cuda":
            reason = f"expert worker {self.name} is on {self.device}, not CUDA"
        elif message.host_id != host_identity():
            reason = f"peer host {message.host_id!r} is not this host {host_identity()!r}"
        if reason is None:
            try:
                ring = AttachedRing(message, self.device)
            except (RuntimeError, ValueError, OSError) as error:
                reason = f"mapping failed: {type(error).__name__}: {error}"[:300]
        if reason is not None:
            log.warning("expert.cuda_ipc_refused", name=self.name, channel_id=message.channel_id, reason=reason)
            return CudaIpcAttached(channel_id=message.channel_id, accepted=False, reason=reason)
        self._rings[message.channel_id] = ring
        log.info("expert.cuda_ipc_attached", name=self.name, channel_id=message.channel_id,
                 num_slots=message.num_slots, max_tokens=message.max_tokens, device=str(self.device),
                 sync=str(ring.sync))
        return CudaIpcAttached(channel_id=message.channel_id, accepted=True,
                               combine_event_handles=ring.combine_event_handles(), sync=str(ring.sync))

    def inputs(self, message: DispatchSlot) -> tuple[torch.Tensor, ...] | ErrorReply:
        """(hidden [T, D], ids [T, K] int32, weights [T, K] f32, mask [T, K] bool or None)."""
        ring = self._rings.get(message.channel_id)
        if ring is None:
            return ErrorReply(code=ErrorCode.NOT_FOUND, message=f"no CUDA IPC channel {message.channel_id!r}")
        if message.per_expert_outputs != ring.layout.per_expert_outputs:
            return ErrorReply(code=ErrorCode.MALFORMED, message="per_expert_outputs differs from the attached ring")
        try:
            hidden, ids, weights, mask = ring.inputs(message.slot, message.num_tokens, message.sequence)
        except ValueError as error:
            return ErrorReply(code=ErrorCode.MALFORMED, message=str(error)[:200])
        self.num_slot_dispatches += 1
        return hidden, ids, weights, (mask if message.has_slot_mask else None)

    def reply(self, message: DispatchSlot, output: torch.Tensor) -> CombineSlot | ErrorReply:
        ring = self._rings[message.channel_id]
        try:
            ring.write_output(message.slot, output, message.sequence)
        except ValueError as error:
            return ErrorReply(code=ErrorCode.INTERNAL, message=str(error)[:200])
        return CombineSlot(dispatch_id=message.dispatch_id, step_id=message.step_id, layer=message.layer,
                           micro_batch=message.micro_batch, slot=message.slot, num_tokens=message.num_tokens,
                           per_expert_outputs=message.per_expert_outputs, sequence=message.sequence)

    def detach_all(self) -> None:
        self._rings.clear()

    @property
    def channel_ids(self) -> list[str]:
        return sorted(self._rings)


def holder_outputs(holder: Any, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """[T, K, D] weighted per-slot outputs from a stacked holder (`QuantizedRoutedExperts`); raises
    `common.model.moe.ExpertNotHeld` when a selected slot's expert is not held."""
    return holder.per_expert_outputs(layer, hidden, ids, weights, mask)
