"""GPU-side doorbells: a stream writes a 64-bit value to device memory, another stream waits for it.

CUDA's stream memory operations (`cuStreamWriteValue64`, `cuStreamWaitValue64`, driver API, called
through ctypes because torch does not expose them) order work between two processes without either
host waiting: the writer's stream stores `value` after all its earlier work (the default write
includes a memory fence scoped to the stream, so the data written before it is visible first); the
waiter's stream stalls until `*address >= value` (GEQ on unsigned 64-bit). With per-slot sequence
numbers that only grow, a wait can never be satisfied by an older use of the slot, and 64 bits
never wrap. `StreamFlags.load()` returns None where the driver or device cannot do these
operations (no libcuda, or the self-test write/wait fails); callers then use CUDA IPC events.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("wire")

_WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_VALUE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: fenced after the stream's earlier writes


class StreamFlagError(RuntimeError):
    """A stream memory operation returned a CUDA error code."""


class StreamFlags:
    _loaded: "StreamFlags | None | bool" = False  # False: not tried yet

    def __init__(self, library: ctypes.CDLL) -> None:
        self._wait = _symbol(library, "cuStreamWaitValue64")
        self._write = _symbol(library, "cuStreamWriteValue64")
        for function in (self._wait, self._write):
            function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            function.restype = ctypes.c_int

    @classmethod
    def load(cls, device: "torch.device") -> "StreamFlags | None":
        """The driver's stream memory operations after a self-test on `device`, or None (logged once)."""
        if cls._loaded is False:
            cls._loaded = cls._try_load(device)
        return cls._loaded or None

    @classmethod
    def _try_load(cls, device: "torch.device") -> "StreamFlags | None":
        import torch

        try:
            flags = cls(ctypes.CDLL("libcuda.so.1"))
            probe = torch.zeros(2, dtype=torch.int64, device=device)
            stream = torch.cuda.current_stream(device)
            flags.write(stream, probe.data_ptr(), 7)
            flags.wait_geq(stream, probe.data_ptr(), 7)
            probe[1] = 1  # ordered after the wait
            torch.cuda.synchronize(device)
            if probe.tolist() != [7, 1]:
                raise StreamFlagError(f"self-test read back {probe.tolist()}")
            return flags
        except (OSError, AttributeError, StreamFlagError, RuntimeError) as error:
            log.warning("wire.stream_flags_unavailable", reason=f"{type(error).__name__}: {error}"[:300])
            return None

    def write(self, stream: "torch.cuda.Stream", address: int, value: int) -> None:
        """Enqueue on `stream`: *address = value, after the stream's earlier work."""
        self._check(self._write(ctypes.c_void_p(stream.cuda_stream), address, value, _WRITE_VALUE_DEFAULT), "write")

    def wait_geq(self, stream: "torch.cuda.Stream", address: int, value: int) -> None:
        """Enqueue on `stream`: stall until *address >= value (unsigned 64-bit)."""
        self._check(self._wait(ctypes.c_void_p(stream.cuda_stream), address, value, _WAIT_VALUE_GEQ), "wait")

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise StreamFlagError(f"cuStream{what.capitalize()}Value64 returned CUDA error {code}")


def _symbol(library: ctypes.CDLL, name: str):
    """The CUDA 12 entry point (`_v2`) when the driver has it, else the original one."""
    try:
        return getattr(library, f"{name}_v2")
    except AttributeError:
        return getattr(library, name)
