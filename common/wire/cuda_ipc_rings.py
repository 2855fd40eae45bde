"""The two ends of one CUDA IPC channel (common/wire/cuda_ipc.py has the layout and the reuse argument).

`DispatchRing` (attention side) owns both regions; `AttachedRing` (expert side) maps them. Ordering
between the two processes' streams is either:
- FLAGS: use n of slot s carries sequence q = n (host counter per slot). The attention stream
  writes the slot, then stores q into dispatch flag s; the expert stream waits for
  dispatch flag s >= q, computes, writes the output, stores q into combine flag s; the attention
  stream waits for combine flag s >= q before reading. All four are stream operations: neither
  host blocks on the other, so the attention host can queue a whole step ahead (the CombineSlot
  reply is only *confirmed* later, for errors). The reuse argument of cuda_ipc.py holds with
  "waits for flag >= q" in place of "waits on the event record": a flag only grows, so no wait
  is satisfied by an older use.
- EVENTS: the slot's dispatch event (attention) and combine event (expert), as in cuda_ipc.py;
  the attention host must receive the CombineSlot before its stream may wait on the combine event.
Legend: S slots, T tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moemesh.common.wire.cuda_ipc import (
    RingLayout, RingSync, cuda_device, event_handles, export_buffer, host_identity, import_buffer, import_events,
    layout_of, new_ipc_events, slot_views,
)
from moemesh.common.wire.messages import AttachCudaIpc
from moemesh.common.wire.stream_flags import StreamFlags

if TYPE_CHECKING:
    import torch


class _Views:
    """Cached slot views per (slot, tokens): building five views costs ~20 us of host time per hop."""

    def __init__(self, layout: RingLayout, dispatch_region, combine_region) -> None:
        self.layout = layout
        self.dispatch_region = dispatch_region
        self.combine_region = combine_region
        self._cache: dict[tuple[int, int], tuple] = {}

    def get(self, slot: int, num_tokens: int) -> tuple:
        key = (slot, num_tokens)
        views = self._cache.get(key)
        if views is None:
            views = slot_views(self.layout, self.dispatch_region, self.combine_region, slot, num_tokens)
            self._cache[key] = views
        return views

    def flag_addresses(self, slot: int) -> tuple[int, int]:
        base = self.dispatch_region.data_ptr()
        dispatch_offset, combine_offset = self.layout.flag_offsets(slot)
        return base + dispatch_offset, base + combine_offset


class DispatchRing:
    """Attention side. `acquire` -> a free slot or None; `write` copies a Dispatch into it and signals
    (returns the slot's new sequence number); `output` orders the stream after the expert's signal and
    returns the output view (consume it before `release`)."""

    def __init__(self, channel_id: str, device: "torch.device", layout: RingLayout,
                 sync: RingSync = RingSync.FLAGS) -> None:
        import torch

        self.channel_id = channel_id
        self.device = cuda_device(device)
        self.layout = layout
        self.flags = StreamFlags.load(self.device) if RingSync(sync) is RingSync.FLAGS else None
        self.sync = RingSync.FLAGS if self.flags is not None else RingSync.EVENTS
        # the regions: [S dispatch slots + flags] and [S combine slots], allocated once
        self.dispatch_region = torch.zeros(layout.dispatch_region_bytes, dtype=torch.uint8, device=self.device)
        self.combine_region = torch.zeros(layout.combine_region_bytes, dtype=torch.uint8, device=self.device)
        self.views = _Views(layout, self.dispatch_region, self.combine_region)
        self.dispatch_events = new_ipc_events(self.device, layout.num_slots)
        self.combine_events: list = []  # the expert's, imported by `attached` (events mode)
        self.sequence = [0] * layout.num_slots  # last sequence number written per slot
        self._free_slots = list(range(layout.num_slots))
        torch.cuda.synchronize(self.device)  # zeroed regions and first event records done before export

    def attach_message(self) -> AttachCudaIpc:
        layout = self.layout
        return AttachCudaIpc(
            channel_id=self.channel_id, host_id=host_identity(), num_slots=layout.num_slots,
            max_tokens=layout.max_tokens, hidden_size=layout.hidden_size, top_k=layout.top_k,
            hidden_dtype=layout.hidden_dtype, per_expert_outputs=layout.per_expert_outputs,
            dispatch_region=export_buffer(self.dispatch_region), combine_region=export_buffer(self.combine_region),
            dispatch_event_handles=event_handles(self.dispatch_events), sync=str(self.sync))

    def attached(self, combine_event_handles: tuple[bytes, ...], sync: str = "events") -> None:
        """The expert mapped the rings; adopt its ordering (it may only downgrade flags to events)."""
        import torch

        if RingSync(sync) is RingSync.EVENTS:
            self.sync = RingSync.EVENTS
        if len(combine_event_handles) != self.layout.num_slots:
            raise ValueError(f"{len(combine_event_handles)} combine events for {self.layout.num_slots} slots")
        others = tuple(i for i in range(torch.cuda.device_count()) if i != self.device.index)  # the expert's GPU
        self.combine_events = import_events(self.device.index, combine_event_handles, others)

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.layout.max_tokens

    def acquire(self) -> int | None:
        return self._free_slots.pop(0) if self._free_slots else None

    def peek_free(self) -> int | None:
        """The slot `acquire` would return (to confirm its previous use first)."""
        return self._free_slots[0] if self._free_slots else None

    def write(self, slot: int, hidden: "torch.Tensor", ids: "torch.Tensor", weights: "torch.Tensor",
              slot_mask: "torch.Tensor | None") -> int:
        """hidden [T, D], ids [T, K], weights [T, K], slot_mask [T, K] bool or None -> slot, then the
        signal; returns this use's sequence number."""
        import torch

        views = self.views.get(slot, hidden.shape[0])
        views[0].copy_(hidden)
        views[1].copy_(ids)
        views[2].copy_(weights)
        if slot_mask is not None:
            views[3].copy_(slot_mask)
        self.sequence[slot] += 1
        stream = torch.cuda.current_stream(self.device)
        if self.sync is RingSync.FLAGS:
            self.flags.write(stream, self.views.flag_addresses(slot)[0], self.sequence[slot])
        else:
            self.dispatch_events[slot].record(stream)
        return self.sequence[slot]

    def output(self, slot: int, num_tokens: int) -> "torch.Tensor":
        """The expert's output of `slot`'s current use [T, D] (or [T, K, D]), ordered after its signal."""
        import torch

        stream = torch.cuda.current_stream(self.device)
        if self.sync is RingSync.FLAGS:
            self.flags.wait_geq(stream, self.views.flag_addresses(slot)[1], self.sequence[slot])
        else:
            stream.wait_event(self.combine_events[slot])
        return self.views.get(slot, num_tokens)[4]

    def unblock(self, slot: int) -> None:
        """Flags: store the current sequence into the combine flag from a side stream, so that a stream
        waiting for an expert that will never answer moves on (its step is discarded)."""
        import torch

        if self.sync is RingSync.FLAGS:
            side = torch.cuda.Stream(self.device)
            self.flags.write(side, self.views.flag_addresses(slot)[1], self.sequence[slot])

    def release(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.layout.num_slots:
            raise ValueError(f"slot {slot} released twice or out of range")
        self._free_slots.append(slot)


class AttachedRing:
    """Expert side: the mapped regions, the peer's dispatch events / flags (waited on) and its own
    combine events / flags (signalled after an output is written), on the expert's device."""

    def __init__(self, message: AttachCudaIpc, device: "torch.device") -> None:
        import torch

        self.channel_id = message.channel_id
        self.device = cuda_device(device)
        self.layout = layout_of(message)
        if len(message.dispatch_event_handles) != self.layout.num_slots:
            raise ValueError("one dispatch event per slot expected")
        # flags only on the rings' own device: waiting on a peer GPU's memory is not relied upon
        same_device = message.dispatch_region.device_index == self.device.index
        self.flags = (StreamFlags.load(self.device) if RingSync(message.sync) is RingSync.FLAGS and same_device
                      else None)
        self.sync = RingSync.FLAGS if self.flags is not None else RingSync.EVENTS
        self.dispatch_region = import_buffer(message.dispatch_region)
        self.combine_region = import_buffer(message.combine_region)
        need = (self.layout.dispatch_region_bytes, self.layout.combine_region_bytes)
        have = (self.dispatch_region.numel(), self.combine_region.numel())
        if have != need:
            raise ValueError(f"shared regions of {have} bytes, the layout needs {need}")
        self.views = _Views(self.layout, self.dispatch_region, self.combine_region)
        # imported on this (the waiting) device: a stream may wait on an event of any device
        self.dispatch_events = import_events(self.device.index, message.dispatch_event_handles,
                                             (message.dispatch_region.device_index,))
        self.combine_events = new_ipc_events(self.device, self.layout.num_slots)
        torch.cuda.synchronize(self.device)

    def combine_event_handles(self) -> tuple[bytes, ...]:
        return event_handles(self.combine_events)

    def inputs(self, slot: int, num_tokens: int, sequence: int) -> tuple["torch.Tensor", ...]:
        """(hidden, ids, weights, mask) views of `slot`, ordered after the sender's signal of `sequence`."""
        import torch

        stream = torch.cuda.current_stream(self.device)
        if self.sync is RingSync.FLAGS:
            self.flags.wait_geq(stream, self.views.flag_addresses(slot)[0], sequence)
        else:
            stream.wait_event(self.dispatch_events[slot])
        return self.views.get(slot, num_tokens)[:4]

    def write_output(self, slot: int, output: "torch.Tensor", sequence: int) -> None:
        """Copy `output` into the slot's combine part, then signal `sequence`."""
        import torch

        target = self.views.get(slot, output.shape[0])[4]
        if tuple(target.shape) != tuple(output.shape):
            raise ValueError(f"output {tuple(output.shape)} does not fit combine slot {tuple(target.shape)}")
        target.copy_(output)
        stream = torch.cuda.current_stream(self.device)
        if self.sync is RingSync.FLAGS:
            self.flags.write(stream, self.views.flag_addresses(slot)[1], sequence)
        else:
            self.combine_events[slot].record(stream)
