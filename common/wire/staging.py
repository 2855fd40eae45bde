"""Fixed pools of host staging buffers for tensor frames (the tensor path: imports torch).

Send side (`SendStagingPool`): every outgoing tensor of a message is copied into one leased
buffer (pinned when CUDA is available, so device->host copies are DMA), the frames are views
of that buffer, and the message is sent with `copy=False, track=True`. The buffer returns
to the pool only when ZeroMQ's MessageTracker says libzmq released the frames; until then
nothing may write it. No buffer is allocated after construction: when all are in flight,
`acquire` waits up to a bound and then raises StagingExhausted.

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

from common.wire import tensors
from common.wire.errors import StagingExhausted, WireError

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("wire")

_ALIGN_BYTES = 64  # every tensor in a staging buffer starts on a cache-line boundary


@dataclass(frozen=True)
class StagingConfig:
    num_buffers: int = 8
    buffer_bytes: int = 64 << 20  # one message's tensors must fit in one buffer
    max_wait_s: float = 2.0  # how long acquire waits for a send to complete
    pin_memory: bool | None = None  # None: pin iff CUDA is available


def _should_pin(pin_memory: bool | None) -> bool:
    import torch

    return torch.cuda.is_available() if pin_memory is None else pin_memory


class SendLease:
    """One leased buffer, filled by `write` (the codec's tensor_writer) with one message's
    tensors, then handed back with `release_after(tracker)` once the message is sent."""

    def __init__(self, pool: "SendStagingPool", index: int) -> None:
        self.pool = pool
        self.index = index
        self.num_used_bytes = 0
        self._has_device_copies = False

    def write(self, tensor: "torch.Tensor") -> tuple[str, tuple[int, ...], memoryview]:
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
            storage[start:end].copy_(source, non_blocking=source.device.type != "cpu")
            self._has_device_copies |= source.device.type != "cpu"
        self.num_used_bytes = (end + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES
        return name, shape, self.pool.views[self.index][start:end]

    def seal(self) -> None:
        """Wait for device->host copies into this buffer; call before sending its frames."""
        if self._has_device_copies:
            import torch

            torch.cuda.current_stream().synchronize()

    def release_after(self, tracker: zmq.MessageTracker | None) -> None:
        """Give the buffer back; it is reused only once `tracker` is done (None: now)."""
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
            try:
                self._in_flight[oldest_index].wait(remaining_s)
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

    def _collect_done(self) -> None:
        for index in [index for index, tracker in self._in_flight.items() if tracker.done]:
            del self._in_flight[index]
            self._free_indices.append(index)


def send_staged(socket: zmq.Socket, pool: SendStagingPool, frames_for: Any, prefix: tuple[bytes, ...] = ()) -> None:
    """Encode with `frames_for(tensor_writer) -> frames`, send zero-copy, recycle on completion.

    Blocking (sync socket) helper for the attention worker's hot path.
    """
    lease = pool.acquire()
    try:
        frames = frames_for(lease.write)
        lease.seal()
        tracker = socket.send_multipart([*prefix, *frames], copy=False, track=True)
    except BaseException:
        lease.release_after(None)  # nothing was handed to zmq
        raise
    lease.release_after(tracker)


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
        on_device = landing.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[index] = event
        return on_device
