"""Native CPU kernel for FP4 routed experts (`cpu_fp4.c`): build at first use, ctypes binding, torch references.

Why native: dequantising FP4 per call in torch (tables, gathers, scale multiplies, then a GEMV) reads
the weights at ~0.7 GB/s on 16 threads of the H200 host, ~100x under its memory bandwidth; decoding
nibbles in registers right before the FMAs (as llama.cpp's Q4 paths do) costs a few vector ops per
32 weights, so the kernel can stream weights at memory speed.

Build (`cpu_fp4_build.py`): compiled once per (sources, flags, compiler, host CPU) into a cache
directory, installed atomically. Failing to build raises `NativeBuildError` with the compiler's output;
`native_kernel()` turns that into None plus one warning event (`cpu_fp4.unavailable`), so callers fall
back to torch. `MOEMESH_CPU_KERNEL=torch` forces the fallback.

Threads: `Executor.POOL` (default; `cpu_fp4_pool.h`, pthreads) or `Executor.OPENMP`
(`MOEMESH_CPU_KERNEL_EXECUTOR=openmp`); the thread count is an argument of every call (the expert
worker passes `CpuBlockRunner.num_threads`, i.e. torch.get_num_threads() when the worker loaded).
Without OpenMP support the library is rebuilt without -fopenmp (the pool needs only pthreads).

Values equal the torch references below up to fp32 summation order (every weight decodes to the
reference's exact fp32 value). Tensors are passed by data pointer and must stay alive during a call
(ctypes releases the GIL for the call, so other Python threads run meanwhile).
Legend: T tokens, K inputs, N outputs, R selected rows, D hidden, I expert width, E stacked experts.
"""

from __future__ import annotations

import ctypes
import enum
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from moemesh.common.kernels.cpu_fp4_build import (BuildConfig, NativeBuildError, build_library, default_cache_dir,
                                          find_compiler)
from moemesh.common.kernels.reference import FP4_BLOCK_SIZE, dequant_fp4, scale_bytes, swiglu_reference

__all__ = ["BuildConfig", "Executor", "ExpertGroups", "ExpertStacks", "NativeBuildError", "NativeFp4", "build_library",
           "default_cache_dir", "find_compiler", "fp4_expert_reference", "fp4_linear_reference", "load_native",
           "native_kernel", "unavailable_reason"]

log = structlog.get_logger("cpu_fp4")

KERNEL_ENV = "MOEMESH_CPU_KERNEL"  # "torch" forces the torch fallback; anything else (or unset): native if it builds
EXECUTOR_ENV = "MOEMESH_CPU_KERNEL_EXECUTOR"  # "pool" (default) or "openmp"
SPIN_ENV = "MOEMESH_CPU_KERNEL_SPIN_US"  # how long idle pool workers poll before sleeping (default 50)
DEFAULT_SPIN_US = 50.0

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class Executor(enum.Enum):
    """Who runs the kernel's chunks. POOL: the work-claiming thread pool of cpu_fp4_pool.h, where the
    caller waits only for chunks in progress, never for idle or descheduled threads (the default: the
    CPU expert worker shares its host with busy processes). OPENMP: `omp for` per phase, each ending in
    a barrier over every thread (kept to measure against; serial when built without OpenMP)."""

    POOL = 0
    OPENMP = 1

    @classmethod
    def from_env(cls) -> Executor:
        value = os.environ.get(EXECUTOR_ENV, "pool").strip().lower()
        if value not in ("pool", "openmp"):
            raise ValueError(f"{EXECUTOR_ENV} must be 'pool' or 'openmp', got {value!r}")
        return cls.OPENMP if value == "openmp" else cls.POOL


class NativeFp4:
    """The loaded library. `linear` and `experts` take torch CPU tensors; see cpu_fp4.c for the math."""

    def __init__(self, path: Path) -> None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise NativeBuildError(f"cannot load {path}: {error}") from error
        lib.moemesh_fp4_init.restype = None
        lib.moemesh_fp4_init()
        lib.moemesh_fp4_isa.restype = ctypes.c_char_p
        lib.moemesh_fp4_has_openmp.restype = ctypes.c_int
        lib.moemesh_fp4_linear.restype = ctypes.c_int
        lib.moemesh_fp4_linear.argtypes = [_ptr, ctypes.c_int, _i64, _i64, _ptr, _ptr, _i64, _ptr, ctypes.c_int,
                                           ctypes.c_int]
        lib.moemesh_fp4_experts.restype = ctypes.c_int
        lib.moemesh_fp4_experts.argtypes = (
            [_ptr, ctypes.c_int, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr]
            + [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64]
            + [ctypes.c_int, ctypes.c_float, ctypes.c_int, _ptr, ctypes.c_int, ctypes.c_int])
        lib.moemesh_fp4_experts_routed.restype = ctypes.c_int
        lib.moemesh_fp4_experts_routed.argtypes = (
            [_ptr, ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64]
            + [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64]
            + [ctypes.c_int, ctypes.c_float, ctypes.c_int, _ptr, ctypes.c_int, ctypes.c_int])
        self._lib = lib
        self.path = path
        self.isa: str = lib.moemesh_fp4_isa().decode()
        self.has_openmp = bool(lib.moemesh_fp4_has_openmp())
        self.executor = Executor.from_env()  # the default of linear() / experts()
        lib.moemesh_fp4_set_idle_ns.restype = None
        lib.moemesh_fp4_set_idle_ns.argtypes = [_i64]
        self.set_idle_spin_us(float(os.environ.get(SPIN_ENV, DEFAULT_SPIN_US)))

    def set_idle_spin_us(self, spin_us: float) -> None:
        """How long idle pool workers poll for the next call before sleeping (process-wide)."""
        self._lib.moemesh_fp4_set_idle_ns(int(spin_us * 1e3))
        self.idle_spin_us = spin_us

    def _threads(self, num_threads: int | None) -> int:
        return max(1, num_threads if num_threads is not None else torch.get_num_threads())

    def linear(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, num_threads: int | None = None,
               out: torch.Tensor | None = None, executor: Executor | None = None) -> torch.Tensor:
        """x [T, K] (fp32 or bf16) @ dequant(packed [N, K/2], scale [N, K/32])ᵀ -> fp32 [T, N] (into `out`)."""
        x = _activations(x)
        packed, scale = _weight_bytes(packed), scale_bytes(scale).contiguous()
        num_tokens, num_in = x.shape
        num_out = packed.shape[0]
        if packed.shape[1] * 2 != num_in or scale.shape != (num_out, num_in // FP4_BLOCK_SIZE) or num_in % 32:
            raise ValueError(f"FP4 weight {tuple(packed.shape)} / scale {tuple(scale.shape)} for input "
                             f"{tuple(x.shape)}")
        if out is None:
            out = torch.empty(num_tokens, num_out, dtype=torch.float32)
        if out.shape != (num_tokens, num_out) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous fp32 [{num_tokens}, {num_out}]")
        status = self._lib.moemesh_fp4_linear(x.data_ptr(), int(x.dtype == torch.bfloat16), num_tokens, num_in,
                                              packed.data_ptr(), scale.data_ptr(), num_out, out.data_ptr(),
                                              self._threads(num_threads), (executor or self.executor).value)
        _check_status(status)
        return out

    def experts(self, hidden: torch.Tensor, groups: ExpertGroups, stacks: ExpertStacks, swiglu_limit: float | None,
                route_before_w2: bool, out: torch.Tensor, num_threads: int | None = None,
                executor: Executor | None = None) -> torch.Tensor:
        """Every row of `groups` through its expert; writes fp32 rows of `out` [*, D] (rows not named are
        left alone). hidden [T, D] fp32 or bf16; `swiglu_limit` None (or 0) means no clamp, as `_swiglu`."""
        hidden = _activations(hidden)
        num_in = hidden.shape[1]
        if (stacks.hidden_size != num_in or out.shape[1] != num_in or out.dtype != torch.float32
                or not out.is_contiguous()):
            raise ValueError(f"hidden {tuple(hidden.shape)} / out {tuple(out.shape)} {out.dtype} do not fit the "
                             f"experts' width {stacks.hidden_size}")
        num_groups = groups.stack_ids.numel()
        if num_groups == 0:
            return out
        has_limit = bool(swiglu_limit)
        status = self._lib.moemesh_fp4_experts(
            hidden.data_ptr(), int(hidden.dtype == torch.bfloat16), num_in, stacks.inter_size, num_groups,
            groups.offsets.data_ptr(), groups.stack_ids.data_ptr(), groups.row_tokens.data_ptr(),
            groups.row_weights.data_ptr(), groups.row_dest.data_ptr(),
            stacks.w1.data_ptr(), stacks.s1.data_ptr(), stacks.w3.data_ptr(), stacks.s3.data_ptr(),
            stacks.w1.stride(0), stacks.s1.stride(0), stacks.w2.data_ptr(), stacks.s2.data_ptr(),
            stacks.w2.stride(0), stacks.s2.stride(0), int(has_limit), float(swiglu_limit or 0.0),
            int(route_before_w2), out.data_ptr(), self._threads(num_threads), (executor or self.executor).value)
        _check_status(status)
        return out


    def routed_experts(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       slot_mask: torch.Tensor | None, local: torch.Tensor, stacks: ExpertStacks,
                       swiglu_limit: float | None, route_before_w2: bool, out: torch.Tensor,
                       num_threads: int | None = None, executor: Executor | None = None) -> torch.Tensor:
        """`experts` with the grouping done in C from the routing: ids / weights / slot_mask [T, K],
        local [num routed experts] (global id -> stack index); writes row t·K + k of out [T·K, D] fp32
        for every selected slot (others left alone). Same rows, order and values as
        `experts(hidden, ExpertGroups.from_routing(ids, weights, slot_mask, local), ...)`."""
        hidden = _activations(hidden)
        num_tokens, top_k = ids.shape
        num_in = hidden.shape[1]
        if (stacks.hidden_size != num_in or out.shape != (num_tokens * top_k, num_in) or out.dtype != torch.float32
                or not out.is_contiguous() or weights.shape != ids.shape or hidden.shape[0] != num_tokens
                or (slot_mask is not None and slot_mask.shape != ids.shape)):
            raise ValueError(f"hidden {tuple(hidden.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)}, "
                             f"out {tuple(out.shape)} {out.dtype} do not fit experts of width {stacks.hidden_size}")
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        mask = None if slot_mask is None else slot_mask.to(torch.bool).contiguous().view(torch.uint8)
        local = local.to(torch.int64).contiguous()
        status = self._lib.moemesh_fp4_experts_routed(
            hidden.data_ptr(), int(hidden.dtype == torch.bfloat16), num_in, stacks.inter_size, num_tokens, top_k,
            ids.data_ptr(), weights.data_ptr(), None if mask is None else mask.data_ptr(), local.data_ptr(),
            local.numel(), stacks.w1.data_ptr(), stacks.s1.data_ptr(), stacks.w3.data_ptr(), stacks.s3.data_ptr(),
            stacks.w1.stride(0), stacks.s1.stride(0), stacks.w2.data_ptr(), stacks.s2.data_ptr(),
            stacks.w2.stride(0), stacks.s2.stride(0), int(bool(swiglu_limit)), float(swiglu_limit or 0.0),
            int(route_before_w2), out.data_ptr(), self._threads(num_threads), (executor or self.executor).value)
        if status == 4:
            raise ValueError(f"expert ids outside 0..{local.numel() - 1}")
        _check_status(status)
        return out


@dataclass(frozen=True)
class ExpertStacks:
    """A layer's stacked FP4 experts as bytes: w1/w3 [E, I, D/2], s1/s3 [E, I, D/32], w2 [E, D, I/2],
    s2 [E, D, I/32], all contiguous uint8 (views of the held tensors, no copies)."""

    w1: torch.Tensor
    s1: torch.Tensor
    w3: torch.Tensor
    s3: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor

    @property
    def hidden_size(self) -> int:
        return self.w1.shape[2] * 2

    @property
    def inter_size(self) -> int:
        return self.w1.shape[1]

    @classmethod
    def from_tensors(cls, w1, s1, w3, s3, w2, s2) -> ExpertStacks:
        """Views of stacked tensors (int8/uint8 weights; uint8/int8/e8m0 scales); checks every shape."""
        stacks = cls(_weight_bytes(w1), scale_bytes(s1).contiguous(), _weight_bytes(w3), scale_bytes(s3).contiguous(),
                     _weight_bytes(w2), scale_bytes(s2).contiguous())
        num_experts, inter, half_hidden = stacks.w1.shape
        hidden = 2 * half_hidden
        expected = {"w1": (num_experts, inter, hidden // 2), "w3": (num_experts, inter, hidden // 2),
                    "s1": (num_experts, inter, hidden // 32), "s3": (num_experts, inter, hidden // 32),
                    "w2": (num_experts, hidden, inter // 2), "s2": (num_experts, hidden, inter // 32)}
        for name, shape in expected.items():
            if tuple(getattr(stacks, name).shape) != shape:
                raise ValueError(f"{name} {tuple(getattr(stacks, name).shape)} != {shape}")
        if hidden % 32 or inter % 32:
            raise ValueError(f"hidden {hidden} and expert width {inter} must be multiples of 32")
        return stacks


@dataclass(frozen=True)
class ExpertGroups:
    """Selected rows of one layer grouped by expert: rows offsets[g]..offsets[g+1] go to stack index
    stack_ids[g]; row r reads hidden[row_tokens[r]], writes out[row_dest[r]], route weight row_weights[r].
    int64 / fp32, contiguous (the kernel reads them by pointer)."""

    offsets: torch.Tensor  # [G + 1] int64
    stack_ids: torch.Tensor  # [G] int64
    row_tokens: torch.Tensor  # [R] int64
    row_weights: torch.Tensor  # [R] fp32
    row_dest: torch.Tensor  # [R] int64

    @classmethod
    def from_routing(cls, ids: torch.Tensor, weights: torch.Tensor, slot_mask: torch.Tensor | None,
                     local: torch.Tensor) -> ExpertGroups:
        """ids / weights / slot_mask [T, K] -> groups in ascending expert id, each expert's rows in
        ascending (token, slot) order (the reference's order); row_dest is the flat slot t·K + k.
        `local` [num routed experts] maps a global expert id to its stack index."""
        top_k = ids.shape[1]
        flat_ids = ids.reshape(-1)
        slots = torch.arange(flat_ids.numel()) if slot_mask is None else torch.where(slot_mask.reshape(-1))[0]
        order = torch.argsort(flat_ids[slots], stable=True)  # by expert; ties keep slot order
        slots = slots[order]  # [R]
        experts, counts = torch.unique_consecutive(flat_ids[slots], return_counts=True)
        offsets = torch.zeros(experts.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        return cls(offsets, local[experts].to(torch.int64).contiguous(), (slots // top_k).contiguous(),
                   weights.reshape(-1)[slots].to(torch.float32).contiguous(), slots.contiguous())


def _activations(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        raise ValueError("the CPU FP4 kernel takes CPU tensors")
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.to(torch.float32)
    return x.contiguous()


def _weight_bytes(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"FP4 weights must be int8/uint8 bytes, got {packed.dtype}")
    if packed.device.type != "cpu":
        raise ValueError("the CPU FP4 kernel takes CPU tensors")
    return packed.view(torch.uint8).contiguous()


def _check_status(status: int) -> None:
    if status == 1:
        raise MemoryError("cpu_fp4: scratch allocation failed")
    if status != 0:
        raise ValueError(f"cpu_fp4: bad arguments (status {status})")


# ---------------------------------------------------------------------- loading

_loaded: dict[BuildConfig, NativeFp4] = {}
_lock = threading.Lock()
_unavailable_reason: str | None = None
_warned = False


def load_native(config: BuildConfig | None = None) -> NativeFp4:
    """The library for `config` (default: the system compiler, no extra flags, with OpenMP if that
    builds, else without); raises NativeBuildError."""
    if config is None:
        compiler = find_compiler()
        if compiler is None:
            raise NativeBuildError("no C compiler found ($CC, cc, gcc, clang)")
        if shutil.which(compiler) is None:
            raise NativeBuildError(f"C compiler {compiler!r} not found")
        try:
            return load_native(BuildConfig(compiler))
        except NativeBuildError as error:
            log.warning("cpu_fp4.openmp_build_failed", reason=str(error)[-500:], retry="without -fopenmp")
            return load_native(BuildConfig(compiler, openmp=False))
    with _lock:
        native = _loaded.get(config)
        if native is None:
            native = _loaded[config] = NativeFp4(build_library(config))
        return native


def native_kernel() -> NativeFp4 | None:
    """The default native kernel, or None (torch fallback) when `MOEMESH_CPU_KERNEL=torch` or it cannot be
    built; logs `cpu_fp4.unavailable` once with the reason."""
    global _unavailable_reason, _warned
    if os.environ.get(KERNEL_ENV, "").strip().lower() == "torch":
        reason = f"{KERNEL_ENV}=torch"
    else:
        try:
            return load_native()
        except NativeBuildError as error:
            reason = str(error)
    _unavailable_reason = reason
    if not _warned:
        _warned = True
        log.warning("cpu_fp4.unavailable", reason=reason, fallback="torch blocked dequantisation")
    return None


def unavailable_reason() -> str | None:
    """Why the last `native_kernel()` call returned None (None if it did not)."""
    return _unavailable_reason


# ---------------------------------------------------------------------- torch references

def fp4_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ dequant(packed [N, K/2], scale [N, K/32])ᵀ in fp32 -> [T, N]."""
    return x.to(torch.float32) @ dequant_fp4(packed, scale).T


def fp4_expert_reference(x: torch.Tensor, w1, s1, w3, s3, w2, s2, swiglu_limit: float | None,
                         route: torch.Tensor | None = None, route_before_w2: bool = False) -> torch.Tensor:
    """One expert on rows x [R, D] in fp32 -> [R, D]: w2(swiglu(x w1ᵀ, x w3ᵀ)) times the route weight
    [R] before w2 or after. No clamp when `swiglu_limit` is None or 0 (as `common.model.moe._swiglu`)."""
    act = swiglu_reference(fp4_linear_reference(x, w1, s1), fp4_linear_reference(x, w3, s3), swiglu_limit or None)
    if route is not None and route_before_w2:
        act = act * route.to(torch.float32)[:, None]
    y = fp4_linear_reference(act, w2, s2)
    if route is not None and not route_before_w2:
        y = y * route.to(torch.float32)[:, None]
    return y
