"""Fixed pools of host staging buffers for tensor frames (the tensor path: imports torch).

Send side (`SendStagingPool`): every outgoing tensor of a message is copied into one leased
buffer (pinned when CUDA is available, so device->host copies are DMA), and the message's
frames are views of that buffer. `stage` turns them into a `TrackedMessage`
(common/wire/tracked_send.py): frames under ZeroMQ's copy threshold are copied out at once, the
others go zero-copy, and ONE tracker covers every zero-copy frame. The buffer returns to the
pool only when that tracker is done, i.e. when neither libzmq nor Python holds any frame of it;
until then nothing may write it. (pyzmq's own `send_multipart(track=True)` returns the tracker
of the last frame only, which is finished at once when that frame is small: trusting it let a
buffer be rewritten while its big frames were still queued.)
Device tensors are copied into the buffer asynchronously, except those small enough to be
inlined in the header, which the codec reads at once; `seal` waits for the rest on the streams
of the devices they came from. No buffer is allocated after construction: when all are in
flight, `acquire` waits up to a bound and then raises StagingExhausted. (That wait blocks the
calling thread, an event loop included; an asyncio send still queued behind the high-water
mark cannot complete meanwhile, so an asyncio sender that can queue should size its pool.)

Receive side (`RecvStagingRing`): a received frame is copied into a pinned slot and sent
to the device with `non_blocking=True`; a slot is reused only after the CUDA event recorded
behind its copy has completed. For a CPU device the frame view itself is returned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import zmq

from moemesh.common.wire import tensors
from moemesh.common.wire.errors import StagingExhausted, WireError
from moemesh.common.wire.schema import DEFAULT_LIMITS
from moemesh.common.wire.tracked_send import TrackedMessage

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("wire")

_ALIGN_BYTES = 64  # every tensor in a staging buffer starts on a cache-line boundary
_WAIT_SLICE_S = 0.002  # acquire re-checks every in-flight send this often while it waits


@dataclass(frozen=True)
class StagingConfig:
    num_buffers: int = 8
    buffer_bytes: int = 64 << 20  # one message's tensors must fit in one buffer
    max_wait_s: float = 2.0  # how long acquire waits for a send to complete
    pin_memory: bool | None = None  # None: pin iff CUDA is available
    # Device tensors up to this size are copied to the host synchronously: the codec reads a
    # tensor of up to WireLimits.max_inline_tensor_bytes at once (it travels inside the header),
    # before `seal`, so its bytes must be there when `write` returns. Must be >= that limit.
    max_sync_copy_bytes: int = DEFAULT_LIMITS.max_inline_tensor_bytes


def _should_pin(pin_memory: bool | None) -> bool:
    import torch

    return torch.cuda.is_available() if pin_memory is None else pin_memory


class SendLease:
    """One leased buffer, filled by `write` (the codec's tensor_writer) with one message's
    tensors, then handed back with `release_after(tracker)`: the tracker must cover every
    frame that views the buffer (`TrackedMessage.tracker`), not just the last one sent."""

    def __init__(self, pool: "SendStagingPool", index: int) -> None:
        self.pool = pool
        self.index = index
        self.num_used_bytes = 0
        self._copy_devices: set[Any] = set()  # devices with device->host copies still to wait for

    def write(self, tensor: "torch.Tensor") -> tuple[str, tuple[int, ...], memoryview]:
        """Copy `tensor` into the buffer; returns (dtype name, shape, view of its bytes).

        A device tensor larger than `max_sync_copy_bytes` is copied asynchronously (on the
        current stream of ITS device) and its view is valid only after `seal`; a smaller one is
        copied synchronously, because the codec reads inline tensors at once. (Reading a pending
        async copy would give stale expert ids, weights and masks.)
        """
        name = tensors.dtype_name(tensor.dtype)
        shape = tuple(int(size) for size in tensor.shape)
        num_bytes = tensor.numel() * tensor.element_size()
        start = self.num_used_bytes
        end = start + num_bytes
        storage = self.pool.storages[self.index]  # [buffer_bytes] u8
        if end > storage.numel():
            raise WireError(f"message tensors need more than {storage.numel()} staging bytes")
        if num_bytes:
            source = tensor.detach().contiguous().reshape(-1).view(storage.dtype)  # [num_bytes] u8
            is_async = source.device.type == "cuda" and num_bytes > self.pool.config.max_sync_copy_bytes
            storage[start:end].copy_(source, non_blocking=is_async)
            if is_async:
                self._copy_devices.add(source.device)
        self.num_used_bytes = (end + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES
        return name, shape, self.pool.views[self.index][start:end]

    def seal(self) -> None:
        """Wait for the asynchronous device->host copies into this buffer; call before any of
        its frames is copied or sent. Each copy ran on the current stream of its source's device
        (not necessarily the current device), so that stream is the one waited for."""
        if self._copy_devices:
            import torch

            for device in self._copy_devices:
                torch.cuda.current_stream(device).synchronize()
            self._copy_devices.clear()

    def release_after(self, tracker: zmq.MessageTracker | None) -> None:
        """Give the buffer back; it is reused only once `tracker` is done (None: now, which is
        right only when no frame viewing the buffer was built)."""
        self.pool._release(self.index, tracker)


class SendStagingPool:
    def __init__(self, config: StagingConfig = StagingConfig()) -> None:
        import torch

        if config.num_buffers < 1 or config.buffer_bytes < 1:
            raise ValueError("a staging pool needs at least one non-empty buffer")
        self.config = config
        self.is_pinned = _should_pin(config.pin_memory)
        # N buffers of B bytes each, allocated once, never again.
        self.storages = [
            torch.empty(config.buffer_bytes, dtype=torch.uint8, pin_memory=self.is_pinned)
            for _ in range(config.num_buffers)
        ]
        self.views = [memoryview(storage.numpy()).cast("B") for storage in self.storages]
        self._free_indices: list[int] = list(range(config.num_buffers))
        self._in_flight: dict[int, zmq.MessageTracker] = {}  # index -> tracker of its send
        self.num_leases = 0  # counters for tests and metrics
        self.num_reuses_after_wait = 0

    @property
    def num_free(self) -> int:
        self._collect_done()
        return len(self._free_indices)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def acquire(self, max_wait_s: float | None = None) -> SendLease:
        """A free buffer; waits (up to max_wait_s, default from config) for the oldest
        in-flight send to complete when none is free, then raises StagingExhausted."""
        wait_s = self.config.max_wait_s if max_wait_s is None else max_wait_s
        deadline = time.monotonic() + wait_s
        self._collect_done()
        while not self._free_indices:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0 or not self._in_flight:
                log.warning("wire.staging_exhausted", num_buffers=self.config.num_buffers, waited_s=wait_s)
                raise StagingExhausted(
                    f"all {self.config.num_buffers} staging buffers in flight after {wait_s:.3f}s"
                )
            oldest_index = next(iter(self._in_flight))
            try:  # in slices: a later send may finish first (an asyncio send queued at the HWM, inproc)
                self._in_flight[oldest_index].wait(min(remaining_s, _WAIT_SLICE_S))
            except zmq.NotDone:
                pass
            self._collect_done()
            self.num_reuses_after_wait += bool(self._free_indices)
        self.num_leases += 1
        return SendLease(self, self._free_indices.pop(0))

    def _release(self, index: int, tracker: zmq.MessageTracker | None) -> None:
        if tracker is None or tracker.done:
            self._free_indices.append(index)
        else:
            self._in_flight[index] = tracker

    def stage(self, frames_for: Any, prefix: tuple[Any, ...] = (), *,
              copy_threshold: int = zmq.COPY_THRESHOLD) -> TrackedMessage:
        """Lease a buffer, encode with `frames_for(tensor_writer) -> frames` into it, and return
        `[*prefix, *frames]` as a TrackedMessage to send once (sync or asyncio socket).

        The lease is already handed back against the message's tracker, which stays pending
        while the unsent message holds its zero-copy frames; so the caller only sends it (a
        failed or cancelled send drops the frames, and the buffer comes back by itself).
        """
        lease = self.acquire()
        try:
            frames = frames_for(lease.write)
            lease.seal()  # device->host copies land before any frame is copied or queued
            outgoing = TrackedMessage([*prefix, *frames], copy_threshold)
        except BaseException:
            lease.release_after(None)  # no frame of the buffer can reach libzmq any more
            raise
        lease.release_after(outgoing.tracker)
        return outgoing

    def _collect_done(self) -> None:
        for index in [index for index, tracker in self._in_flight.items() if tracker.done]:
            del self._in_flight[index]
            self._free_indices.append(index)


def send_staged(socket: zmq.Socket, pool: SendStagingPool, frames_for: Any, prefix: tuple[bytes, ...] = ()) -> None:
    """Encode with `frames_for(tensor_writer) -> frames`, send zero-copy, recycle on completion.

    Blocking (sync socket) helper for the attention worker's hot path.
    """
    copy_threshold = getattr(socket, "copy_threshold", zmq.COPY_THRESHOLD)
    pool.stage(frames_for, prefix, copy_threshold=copy_threshold).send(socket)


class RecvStagingRing:
    """Pinned landing slots for received tensors bound for a CUDA device.

    Each slot holds one tensor of up to `slot_bytes`; a slot is reused only after the event
    recorded behind its host->device copy has completed (waited, not raced). For a CPU
    device `to_device` returns the received view unchanged (no copy, no slot).
    """

    def __init__(self, device: str, num_slots: int = 4, slot_bytes: int = 64 << 20) -> None:
        import torch

        self.device = torch.device(device)
        self._slots = []
        self._events: list[Any] = []
        self._next_slot = 0
        if self.device.type == "cuda":
            if num_slots < 1:
                raise ValueError("a landing ring needs at least one slot")
            self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_slots)]
            self._events = [None] * num_slots

    def to_device(self, tensor: "torch.Tensor") -> "torch.Tensor":
        if self.device.type != "cuda":
            return tensor.to(self.device)
        import torch

        num_bytes = tensor.numel() * tensor.element_size()
        index = self._next_slot
        self._next_slot = (index + 1) % len(self._slots)
        slot = self._slots[index]
        if num_bytes > slot.numel():
            raise WireError(f"received tensor of {num_bytes} bytes exceeds the landing slot")
        if self._events[index] is not None:
            self._events[index].synchronize()  # the previous copy out of this slot is done
        landing = slot[:num_bytes].view(tensor.dtype).view(tensor.shape)
        landing.copy_(tensor)
        on_device = landing.to(self.device, non_blocking=True)  # on the current stream of self.device
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # that stream, even when another device is current
        self._events[index] = event
        return on_device
