"""CUDA IPC data plane between processes on one host: device rings shared once, ZeroMQ as the doorbell.

The attention worker allocates, per expert worker, one *dispatch region* and one *combine region*
on its own device, each a single uint8 device tensor carved into `num_slots` slots (`RingLayout`),
and hands their CUDA IPC handles to the expert worker once (`AttachCudaIpc`). Per MoE layer and
micro-batch it then copies the activations into a free slot on its stream, records that slot's
*dispatch event* and sends only a small control message (`DispatchSlot`: slot, token count,
layer, ids). The expert worker makes its stream wait on the event, computes from the slot, writes
its output into the same slot of the combine region, records that slot's *combine event* and
answers `CombineSlot`; the attention worker makes its stream wait on the combine event and reads.
No host copy, no host sync on either side: ordering is carried entirely by the two events. The
faster ordering by per-slot sequence flags that the streams write and wait on themselves (no host
round trip at all) is in cuda_ipc_rings.py, which holds the two ends (`DispatchRing`,
`AttachedRing`); the argument below holds for it with "waits until flag >= sequence".

Why a slot is never overwritten while the peer still reads it (the events are CUDA IPC events;
a `cudaStreamWaitEvent` waits for the most recent `cudaEventRecord` issued before it):
- the attention side writes dispatch slot s again only after it received the CombineSlot of s's
  previous use *and* enqueued its wait on combine event s; the expert recorded that event after
  enqueueing its reads of s, so the new write is ordered after those reads on the device;
- the expert writes combine slot s again only for a later DispatchSlot of s, which the attention
  side sends after enqueueing its read of the previous output (then records dispatch event s
  after that read); the expert waits on that record before writing, so the read comes first;
- each event is re-recorded only after the peer enqueued its wait on the previous record: the
  next record of dispatch event s follows the CombineSlot reply (sent after the expert's wait),
  the next record of combine event s follows the next DispatchSlot (sent after the attention
  side's wait). So no wait can ever see a newer record than the one meant for it.
A slot is freed by the attention side only in `DispatchRing.release`, after its output was
consumed; with no free slot, or more tokens than a slot holds, the caller sends over ZeroMQ.

Each side creates the events it *records* on its own device (torch refuses to record an event
on another device's stream) and imports the peer's events only to wait on them, so the two
processes may sit on two GPUs of one host with peer access (the expert then reads and writes
the attention device's memory through the IPC mapping, a peer copy).

Host identity (`host_identity`): hostname and kernel boot id; CUDA IPC is attempted only when
both peers report the same identity and both are on CUDA, otherwise the channel falls back to
ZeroMQ with host staging and logs `attention.data_plane_fallback`.
Legend: S slots, T max tokens per slot, D hidden, K top-k.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from moemesh.common.wire import tensors
from moemesh.common.wire.messages import AttachCudaIpc, SharedCudaBuffer

if TYPE_CHECKING:
    import torch

_ALIGN_BYTES = 256  # every slot part starts on a 256-byte boundary (vectorised kernels)


class DataPlane(StrEnum):
    """How Dispatch / Combine tensors travel between the attention and an expert worker."""

    ZMQ = "zmq"  # tensor frames through pinned host staging: any device, any host
    CUDA_IPC = "cuda_ipc"  # shared device rings, ZeroMQ carries the control message (same host, CUDA)
    MAILBOX = "mailbox"  # host-memory mailbox and a native worker loop, no message per layer (same host, CPU experts)


@dataclass(frozen=True)
class CudaIpcConfig:
    """num_slots: dispatches in flight per expert worker (>= micro-batches); max_tokens: rows per slot
    (larger Dispatches, e.g. long prefill chunks, go over ZeroMQ); attach_timeout_s: bound on the
    one-time handshake; sync: how the two processes order their device work (`RingSync`)."""

    num_slots: int = 4
    max_tokens: int = 2048
    attach_timeout_s: float = 30.0
    # "events" by default: "flags" is faster (no host round trip per hop) but a dead expert can leave the
    # attention stream waiting behind a host sync until a watchdog exists (docs/performance.md, run 3)
    sync: str = "events"


class RingSync(StrEnum):
    """FLAGS: per-slot int64 sequence numbers in the shared region, written and waited on by the
    streams themselves (cuStreamWriteValue64 / cuStreamWaitValue64; common/wire/stream_flags.py), so
    neither host waits for the other on the hot path. EVENTS: CUDA IPC events; the attention host
    must receive the CombineSlot before it may wait on the combine event (one host round trip per
    hop). FLAGS falls back to EVENTS when either side's driver lacks the stream memory operations."""

    FLAGS = "flags"
    EVENTS = "events"


def host_identity() -> str:
    """`hostname/boot-id`: equal for two processes iff they run under the same kernel instance."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot_id = handle.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{socket.gethostname()}/{boot_id}"


def _align(num_bytes: int) -> int:
    return (num_bytes + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES


@dataclass(frozen=True)
class RingLayout:
    """Byte offsets of every part of every slot; computed identically on both sides from the
    attach message's sizes (never sent as offsets, so the two cannot disagree)."""

    num_slots: int
    max_tokens: int
    hidden_size: int
    top_k: int
    hidden_dtype: str  # wire dtype name, e.g. "bf16"
    per_expert_outputs: bool

    @property
    def hidden_bytes(self) -> int:  # [T, D]
        return self.max_tokens * self.hidden_size * tensors.DTYPES[self.hidden_dtype][1]

    @property
    def routing_bytes(self) -> int:  # ids [T, K] int32 or weights [T, K] f32
        return self.max_tokens * self.top_k * 4

    @property
    def mask_bytes(self) -> int:  # [T, K] bool
        return self.max_tokens * self.top_k

    @property
    def dispatch_slot_bytes(self) -> int:
        return _align(self.hidden_bytes) + 2 * _align(self.routing_bytes) + _align(self.mask_bytes)

    @property
    def output_bytes(self) -> int:  # [T, D] or [T, K, D]
        return self.hidden_bytes * (self.top_k if self.per_expert_outputs else 1)

    @property
    def combine_slot_bytes(self) -> int:
        return _align(self.output_bytes)

    @property
    def dispatch_region_bytes(self) -> int:
        """S dispatch slots, then the flags: int64 dispatch sequence [S], combine sequence [S]."""
        return self.num_slots * self.dispatch_slot_bytes + _align(16 * self.num_slots)

    @property
    def combine_region_bytes(self) -> int:
        return self.num_slots * self.combine_slot_bytes

    def flag_offsets(self, slot: int) -> tuple[int, int]:
        """Byte offsets of (dispatch flag, combine flag) of `slot` in the dispatch region."""
        base = self.num_slots * self.dispatch_slot_bytes
        return base + 8 * slot, base + 8 * (self.num_slots + slot)

    def dispatch_offsets(self, slot: int) -> tuple[int, int, int, int]:
        """Byte offsets of (hidden, ids, weights, mask) of `slot` in the dispatch region."""
        base = slot * self.dispatch_slot_bytes
        ids = base + _align(self.hidden_bytes)
        weights = ids + _align(self.routing_bytes)
        mask = weights + _align(self.routing_bytes)
        return base, ids, weights, mask


def slot_views(layout: RingLayout, dispatch_region: "torch.Tensor", combine_region: "torch.Tensor", slot: int,
               num_tokens: int) -> tuple["torch.Tensor", ...]:
    """(hidden [T, D], ids [T, K] i32, weights [T, K] f32, mask [T, K] bool, output [T, D] or [T, K, D])
    views of `slot`'s first `num_tokens` rows."""
    import torch

    if not 0 <= slot < layout.num_slots or not 0 < num_tokens <= layout.max_tokens:
        raise ValueError(f"slot {slot} / {num_tokens} tokens outside the ring ({layout.num_slots} x "
                         f"{layout.max_tokens})")
    dtype = tensors.torch_dtype(layout.hidden_dtype)
    item = tensors.DTYPES[layout.hidden_dtype][1]
    d, k = layout.hidden_size, layout.top_k
    h0, i0, w0, m0 = layout.dispatch_offsets(slot)
    hidden = dispatch_region[h0:h0 + num_tokens * d * item].view(dtype).view(num_tokens, d)
    ids = dispatch_region[i0:i0 + num_tokens * k * 4].view(torch.int32).view(num_tokens, k)
    weights = dispatch_region[w0:w0 + num_tokens * k * 4].view(torch.float32).view(num_tokens, k)
    mask = dispatch_region[m0:m0 + num_tokens * k].view(torch.bool).view(num_tokens, k)
    o0 = slot * layout.combine_slot_bytes
    out_shape = (num_tokens, k, d) if layout.per_expert_outputs else (num_tokens, d)
    num_out = num_tokens * d * item * (k if layout.per_expert_outputs else 1)
    output = combine_region[o0:o0 + num_out].view(dtype).view(out_shape)
    return hidden, ids, weights, mask, output


# ----------------------------------------------------------------------------- handles
def export_buffer(region: "torch.Tensor") -> SharedCudaBuffer:
    """A CUDA IPC description of a contiguous uint8 device tensor (its owner must keep it alive)."""
    (device_index, handle, storage_size_bytes, storage_offset_bytes, ref_counter_handle, ref_counter_offset,
     event_handle, event_sync_required) = region.untyped_storage()._share_cuda_()
    return SharedCudaBuffer(
        device_index=int(device_index), handle=bytes(handle), storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes), ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset), event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync_required), tensor_offset=int(region.storage_offset()),
        num_bytes=int(region.numel()))


def import_buffer(shared: SharedCudaBuffer) -> "torch.Tensor":
    """The peer's uint8 device tensor, mapped into this process (on the peer's device index)."""
    import torch

    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        shared.device_index, shared.handle, shared.storage_size_bytes, shared.storage_offset_bytes,
        shared.ref_counter_handle, shared.ref_counter_offset, shared.event_handle or None,
        shared.event_sync_required)
    region = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", shared.device_index))
    return region.set_(storage, shared.tensor_offset, (shared.num_bytes,), (1,))


def cuda_device(device: "torch.device | str") -> "torch.device":
    """`device` with an explicit index (`cuda` -> `cuda:<current>`)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CUDA IPC needs a CUDA device, not {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def new_ipc_events(device: "torch.device", count: int) -> list:
    """`count` interprocess events on `device` (recorded once so each has a CUDA event to share)."""
    import torch

    events = []
    with torch.cuda.device(device):
        for _ in range(count):
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(device))
            events.append(event)
    return events


def event_handles(events: list) -> tuple[bytes, ...]:
    return tuple(bytes(event.ipc_handle()) for event in events)


def import_events(device_index: int, handles: tuple[bytes, ...], other_device_indices: tuple[int, ...] = ()) -> list:
    """The peer's events, opened with `device_index` current (the device whose streams wait on them).
    Across two GPUs the peer created them on its own device; should the driver refuse to open an
    event handle under another device, each of `other_device_indices` is tried in turn (a stream may
    wait on an event of any device either way)."""
    import torch

    tried = []
    for index in (device_index, *other_device_indices):
        try:
            return [torch.cuda.Event.from_ipc_handle(torch.device("cuda", index), handle) for handle in handles]
        except RuntimeError as error:  # torch raises RuntimeError for CUDA errors
            tried.append(f"cuda:{index}: {error}"[:200])
    raise RuntimeError(f"cannot open the peer's CUDA IPC events: {'; '.join(tried)}")


def layout_of(message: AttachCudaIpc) -> RingLayout:
    return RingLayout(num_slots=message.num_slots, max_tokens=message.max_tokens, hidden_size=message.hidden_size,
                      top_k=message.top_k, hidden_dtype=message.hidden_dtype,
                      per_expert_outputs=message.per_expert_outputs)
