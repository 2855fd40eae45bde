"""The CPU expert mailbox's native library: the worker loop (`MailboxWorker`) and the flag operations.

`cpu_mailbox.c` is built with `cpu_fp4.c` into one library at first use (`cpu_fp4_build.build_native`,
same cache and flags as the FP4 kernel), so the worker thread calls the FP4 expert kernel with no
Python in between. At load, the layout constants of cpu_mailbox.h are compared with
`mailbox_layout` (every word offset, error code and state; region offsets of a few shapes), and the
library is refused when they differ.

A `MailboxWorker` is one native thread attached to one segment, started once per placement with the
expert stacks' pointers and the owner table, stopped through the segment's stop word. Python does
nothing per layer. Protocol and ordering: docs/device-step.md.
Legend: L layers, E routed experts, T rows, K top-k slots, D hidden.
"""

from __future__ import annotations

import ctypes
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from moemesh.common.kernels.cpu_fp4 import ExpertStacks, Executor, NativeFp4
from moemesh.common.kernels.cpu_fp4_build import BuildConfig, NativeBuildError, find_compiler
from moemesh.common.kernels.mailbox_layout import CombineMode, MailboxLayout, MailboxSegment, Word, abi_constants
from moemesh.common.kernels.cpu_fp4_build import build_native

log = structlog.get_logger("mailbox")

_KERNELS = Path(__file__).parent
SOURCES = (_KERNELS / "cpu_mailbox.c", _KERNELS / "cpu_fp4.c")
HEADERS = tuple(_KERNELS / n for n in ("cpu_mailbox.h", "cpu_fp4_tile.h", "cpu_fp4_pool.h"))

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_i64p = ctypes.POINTER(ctypes.c_int64)


class LayerStacks(ctypes.Structure):
    """cpu_mailbox.h mb_layer_stacks."""

    _fields_ = [(name, _ptr) for name in ("w1", "s1", "w3", "s3", "w2", "s2")] + [
        (name, _i64) for name in ("w13_stride", "s13_stride", "w2_stride", "s2_stride")]


@dataclass(frozen=True)
class WaitConfig:
    """How a side waits for the other's flag: spin for `spin_us`, then sleep from `sleep_min_us`
    doubling up to `sleep_max_us` (0: yield the core instead). A core of its own: spin long; a host
    with few shared cores: spin briefly (the default)."""

    spin_us: float = 20.0
    sleep_min_us: float = 2.0
    sleep_max_us: float = 200.0

    def native(self) -> tuple[int, int, int]:
        return int(self.spin_us * 1e3), int(self.sleep_min_us * 1e3), int(self.sleep_max_us * 1e3)


class MailboxLibrary:
    """The loaded library (worker loop, flag operations, FP4 kernel)."""

    def __init__(self, path: Path) -> None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise NativeBuildError(f"cannot load {path}: {error}") from error
        lib.moemesh_mailbox_abi.restype = ctypes.c_int
        lib.moemesh_mailbox_abi.argtypes = [_i64p, ctypes.c_int]
        lib.moemesh_mailbox_layout.restype = None
        lib.moemesh_mailbox_layout.argtypes = [_i64, _i64, _i64, ctypes.c_int, ctypes.c_int, _i64p]
        lib.moemesh_mailbox_store_release.restype = None
        lib.moemesh_mailbox_store_release.argtypes = [_ptr, _i64]
        lib.moemesh_mailbox_load_acquire.restype = _i64
        lib.moemesh_mailbox_load_acquire.argtypes = [_ptr]
        lib.moemesh_mailbox_post.restype = None
        lib.moemesh_mailbox_post.argtypes = [_ptr, _i64, _i64]
        lib.moemesh_mailbox_wait.restype = ctypes.c_int
        lib.moemesh_mailbox_wait.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _i64p]
        lib.moemesh_mailbox_start.restype = _ptr
        lib.moemesh_mailbox_start.argtypes = (
            [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int,
             ctypes.c_int, ctypes.c_int, _i64, _i64, _i64, ctypes.c_char_p, ctypes.c_int])
        lib.moemesh_mailbox_stop.restype = None
        lib.moemesh_mailbox_stop.argtypes = [_ptr, _i64p]
        self._lib = lib
        self.path = path
        self._fp4: NativeFp4 | None = None
        self._check_abi()

    def _check_abi(self) -> None:
        expected = abi_constants()
        values = (ctypes.c_int64 * (len(expected) + 8))()
        count = self._lib.moemesh_mailbox_abi(values, len(values))
        if list(values[:count]) != expected:
            raise NativeBuildError(f"{self.path}: mailbox constants {list(values[:count])} differ from "
                                   f"mailbox_layout's {expected}")
        for layout in (MailboxLayout(1, 32, 1), MailboxLayout(64, 4096, 6, True, CombineMode.SLOTS),
                       MailboxLayout(8, 96, 3, False, CombineMode.PARTIAL)):
            out = (ctypes.c_int64 * 5)()
            self._lib.moemesh_mailbox_layout(layout.t_max, layout.hidden_size, layout.top_k, int(layout.hidden_bf16),
                                             int(layout.combine is CombineMode.SLOTS), out)
            if tuple(out) != layout.regions:
                raise NativeBuildError(f"{self.path}: regions {tuple(out)} of {layout} differ from {layout.regions}")

    def fp4_kernel(self) -> NativeFp4:
        """The FP4 kernel of this library (the worker's machine code), for in-process shares."""
        if self._fp4 is None:
            self._fp4 = NativeFp4(self.path)
        return self._fp4

    # ---------------------------------------------------------------- flag operations

    def store_release(self, address: int, value: int) -> None:
        self._lib.moemesh_mailbox_store_release(address, value)

    def load_acquire(self, address: int) -> int:
        return self._lib.moemesh_mailbox_load_acquire(address)

    def post(self, segment: MailboxSegment, seq: int, num_rows: int) -> None:
        """T, then dispatch_seq = seq with a release store (the slot must be written before)."""
        self._lib.moemesh_mailbox_post(segment.address, seq, num_rows)

    def wait(self, address: int, target: int, timeout_s: float, wait: WaitConfig) -> tuple[int, int]:
        """Waits (GIL released) until the word at `address` reaches `target`: (0 equal / 1 timeout /
        2 passed, the value seen)."""
        seen = ctypes.c_int64(0)
        status = self._lib.moemesh_mailbox_wait(address, target, int(timeout_s * 1e9), *wait.native(),
                                                ctypes.byref(seen))
        return status, seen.value


_loaded: dict[BuildConfig, MailboxLibrary] = {}
_lock = threading.Lock()


def load_mailbox(config: BuildConfig | None = None) -> MailboxLibrary:
    """The mailbox library for `config` (default: the system compiler, without OpenMP: the worker uses
    the work-claiming pool); raises NativeBuildError when it cannot be built or its layout differs."""
    if config is None:
        compiler = find_compiler()
        if compiler is None or shutil.which(compiler) is None:
            raise NativeBuildError(f"no C compiler found ({compiler or '$CC, cc, gcc, clang'})")
        config = BuildConfig(compiler, openmp=False)
    with _lock:
        library = _loaded.get(config)
        if library is None:
            library = _loaded[config] = MailboxLibrary(build_native("cpu_mailbox", SOURCES, HEADERS, config))
        return library


@dataclass(frozen=True)
class ExpertMath:
    """The routed experts' SwiGLU options (as `cpu_experts.expert_rows` takes them)."""

    swiglu_limit: float | None
    route_before_w2: bool = False


def owned_local_table(owner: torch.Tensor, worker_index: int) -> torch.Tensor:
    """owner [L, E] (worker index per (layer, expert)) -> local [L, E] int64: the stack index of each
    expert this worker owns (ascending expert id within a layer), -1 elsewhere."""
    mine = owner == worker_index
    local = torch.cumsum(mine.to(torch.int64), dim=1) - 1
    return torch.where(mine, local, torch.full_like(local, -1)).contiguous()


class MailboxWorker:
    """One native worker thread serving one segment.

    stacks: per layer, the FP4 stacks of the experts this worker owns, in the order `local` numbers
    them (None for a layer it owns none of); local [L, E] int64: stack index or -1. The tensors stay
    referenced here while the thread runs. `stop()` sets the stop word and joins (the thread ends
    between layers); stop the worker before closing its segment."""

    def __init__(self, library: MailboxLibrary, segment: MailboxSegment, stacks: list[ExpertStacks | None],
                 local: torch.Tensor, math: ExpertMath, num_threads: int = 1, wait: WaitConfig = WaitConfig(),
                 pin_cpu: int | None = None, executor: Executor = Executor.POOL) -> None:
        num_layers, num_experts = local.shape
        if len(stacks) != num_layers:
            raise ValueError(f"{len(stacks)} layers of stacks for an owner table of {num_layers} layers")
        self.local = local.to(torch.int64).contiguous()
        inter_size = 0
        table = (LayerStacks * num_layers)()
        for layer, stack in enumerate(stacks):
            owned = int((self.local[layer] >= 0).sum())
            if stack is None:
                if owned:
                    raise ValueError(f"layer {layer}: {owned} experts owned but no stacks")
                continue
            if stack.hidden_size != segment.layout.hidden_size:
                raise ValueError(f"layer {layer}: experts of width {stack.hidden_size}, mailbox of "
                                 f"{segment.layout.hidden_size}")
            if owned and int(self.local[layer].max()) >= stack.w1.shape[0]:
                raise ValueError(f"layer {layer}: stack index {int(self.local[layer].max())} of "
                                 f"{stack.w1.shape[0]} stacked experts")
            if inter_size and stack.inter_size != inter_size:
                raise ValueError(f"layer {layer}: expert width {stack.inter_size}, other layers {inter_size}")
            inter_size = stack.inter_size
            table[layer] = LayerStacks(stack.w1.data_ptr(), stack.s1.data_ptr(), stack.w3.data_ptr(),
                                       stack.s3.data_ptr(), stack.w2.data_ptr(), stack.s2.data_ptr(),
                                       stack.w1.stride(0), stack.s1.stride(0), stack.w2.stride(0), stack.s2.stride(0))
        self.stacks = stacks
        self.segment = segment
        self.library = library
        message = ctypes.create_string_buffer(256)
        handle = library._lib.moemesh_mailbox_start(
            segment.address, segment.layout.total_bytes, num_layers, num_experts, inter_size,
            self.local.data_ptr(), ctypes.addressof(table), int(bool(math.swiglu_limit)),
            float(math.swiglu_limit or 0.0), int(math.route_before_w2), max(1, num_threads), executor.value,
            -1 if pin_cpu is None else pin_cpu, *wait.native(), message, len(message))
        if not handle:
            raise ValueError(f"mailbox worker on {segment.path}: {message.value.decode()}")
        self._handle = handle
        log.info("mailbox.worker_started", segment=str(segment.path), worker_index=segment.worker_index,
                 layers=num_layers, experts_owned=int((self.local >= 0).sum()), num_threads=num_threads,
                 spin_us=wait.spin_us, sleep_max_us=wait.sleep_max_us)

    @property
    def running(self) -> bool:
        return self._handle is not None

    def __enter__(self) -> MailboxWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # the thread reads the stacks this object keeps alive: never outlive them
        if getattr(self, "_handle", None) is not None:
            self.stop()

    def stop(self) -> tuple[int, int]:
        """Stops the thread (between layers) -> (layers served, layers failed)."""
        if self._handle is None:
            return 0, 0
        out = (ctypes.c_int64 * 2)()
        self.library._lib.moemesh_mailbox_stop(self._handle, out)
        self._handle = None
        log.info("mailbox.worker_stopped", segment=str(self.segment.path), layers_served=out[0], layers_failed=out[1])
        return out[0], out[1]


def serve_until_stopped(library: MailboxLibrary, segment: MailboxSegment, stacks: list[ExpertStacks | None],
                        local: torch.Tensor, math: ExpertMath, num_threads: int = 1,
                        wait: WaitConfig = WaitConfig(), pin_cpu: int | None = None) -> tuple[int, int]:
    """A worker process's body: start the native loop and block (GIL released) until someone sets the
    segment's stop word; returns (layers served, layers failed)."""
    worker = MailboxWorker(library, segment, stacks, local, math, num_threads, wait, pin_cpu)
    library.wait(segment.word_address(Word.STOP), 1, -1.0, IDLE_WAIT)
    return worker.stop()


IDLE_WAIT = WaitConfig(spin_us=0.0, sleep_min_us=1000.0, sleep_max_us=50_000.0)  # a control word: no hurry
