"""Native CPU kernel for FP4 routed experts (`cpu_fp4.c`): build at first use, ctypes binding, torch references.

Why native: dequantising FP4 per call in torch (tables, gathers, scale multiplies, then a GEMV) reads
the weights at ~0.7 GB/s on 16 threads of the H200 host, ~100x under its memory bandwidth; decoding
nibbles in registers right before the FMAs (as llama.cpp's Q4 paths do) costs a few vector ops per
32 weights, so the kernel can stream weights at memory speed.

Build: the C source is compiled once per (source, flags, compiler, host CPU) into
`$MOEMESH_CACHE_DIR/kernels/` (default `~/.cache/moemesh/kernels/`) as `cpu_fp4-<hash>.so`, written to a
temporary name and renamed into place, so concurrent workers never load a half-written library. The
hash covers the host CPU because `-march=native` code built on one machine may not run on another
that shares the cache directory. Failing to build raises `NativeBuildError` with the compiler's
output; `native_kernel()` turns that into None plus one warning event (`cpu_fp4.unavailable`), so
callers fall back to torch. `MOEMESH_CPU_KERNEL=torch` forces the fallback.

Values equal the torch references below up to fp32 summation order (every weight decodes to the
reference's exact fp32 value). Tensors are passed by data pointer and must stay alive during a call
(ctypes releases the GIL for the call, so other Python threads run meanwhile).
Legend: T tokens, K inputs, N outputs, R selected rows, D hidden, I expert width, E stacked experts.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from common.kernels.reference import FP4_BLOCK_SIZE, dequant_fp4, scale_bytes, swiglu_reference

log = structlog.get_logger("cpu_fp4")

SOURCE_PATH = Path(__file__).with_name("cpu_fp4.c")
BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
KERNEL_ENV = "MOEMESH_CPU_KERNEL"  # "torch" forces the torch fallback; anything else (or unset): native if it builds
CACHE_ENV = "MOEMESH_CACHE_DIR"
CC_ENV = "CC"

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class NativeBuildError(RuntimeError):
    """The kernel could not be built or loaded; the message says why (compiler output included)."""


@dataclass(frozen=True)
class BuildConfig:
    """How the library is built. `extra_flags` are appended (tests use `-mno-avx512f` etc. to build the
    AVX2 and scalar variants on an AVX-512 host)."""

    compiler: str
    extra_flags: tuple[str, ...] = ()
    cache_dir: Path | None = None

    def flags(self) -> tuple[str, ...]:
        return BASE_FLAGS + self.extra_flags


def find_compiler() -> str | None:
    """$CC, else the first of cc / gcc / clang on PATH."""
    if os.environ.get(CC_ENV):
        return os.environ[CC_ENV]
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "moemesh") / "kernels"


def _host_cpu_id() -> str:
    """Model name and ISA flags of this host's CPU (what -march=native depends on)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "vendor_id"))]
    return "\n".join(dict.fromkeys(keep))  # one copy of each distinct line


def _compiler_id(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"compiler {compiler!r} does not run: {error}") from error


def build_library(config: BuildConfig) -> Path:
    """Compile cpu_fp4.c (once; later calls find the cached file) and return the library's path."""
    source = SOURCE_PATH.read_bytes()
    digest = hashlib.sha256()
    for part in (source, " ".join(config.flags()).encode(), _compiler_id(config.compiler).encode(),
                 _host_cpu_id().encode()):
        digest.update(part)
        digest.update(b"\0")
    cache_dir = config.cache_dir or default_cache_dir()
    target = cache_dir / f"cpu_fp4-{digest.hexdigest()[:20]}.so"
    if target.exists():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise NativeBuildError(f"cache directory {cache_dir} not writable: {error}") from error
    handle, temp_name = tempfile.mkstemp(prefix=".cpu_fp4-", suffix=".so", dir=cache_dir)
    os.close(handle)
    command = [config.compiler, *config.flags(), "-o", temp_name, str(SOURCE_PATH), "-lm"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise NativeBuildError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
        os.replace(temp_name, target)  # atomic: another worker either sees no file or the whole one
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"{' '.join(command)}: {error}") from error
    finally:
        if os.path.exists(temp_name):
            os.unlink(temp_name)
    log.info("cpu_fp4.built", path=str(target), flags=" ".join(config.flags()))
    return target


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
        lib.moemesh_fp4_linear.argtypes = [_ptr, ctypes.c_int, _i64, _i64, _ptr, _ptr, _i64, _ptr, ctypes.c_int]
        lib.moemesh_fp4_experts.restype = ctypes.c_int
        lib.moemesh_fp4_experts.argtypes = (
            [_ptr, ctypes.c_int, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr]
            + [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64]
            + [ctypes.c_int, ctypes.c_float, ctypes.c_int, _ptr, ctypes.c_int])
        self._lib = lib
        self.path = path
        self.isa: str = lib.moemesh_fp4_isa().decode()
        self.has_openmp = bool(lib.moemesh_fp4_has_openmp())

    def _threads(self, num_threads: int | None) -> int:
        return max(1, num_threads if num_threads is not None else torch.get_num_threads())

    def linear(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, num_threads: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] (fp32 or bf16) @ dequant(packed [N, K/2], scale [N, K/32])ᵀ -> fp32 [T, N] (into `out`)."""
        x = _activations(x)
        packed, scale = _weight_bytes(packed), scale_bytes(scale).contiguous()
        num_tokens, num_in = x.shape
        num_out = packed.shape[0]
        if packed.shape[1] * 2 != num_in or scale.shape != (num_out, num_in // FP4_BLOCK_SIZE) or num_in % 32:
            raise ValueError(f"FP4 weight {tuple(packed.shape)} / scale {tuple(scale.shape)} for input {tuple(x.shape)}")
        if out is None:
            out = torch.empty(num_tokens, num_out, dtype=torch.float32)
        if out.shape != (num_tokens, num_out) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous fp32 [{num_tokens}, {num_out}]")
        status = self._lib.moemesh_fp4_linear(x.data_ptr(), int(x.dtype == torch.bfloat16), num_tokens, num_in,
                                              packed.data_ptr(), scale.data_ptr(), num_out, out.data_ptr(),
                                              self._threads(num_threads))
        _check_status(status)
        return out

    def experts(self, hidden: torch.Tensor, groups: ExpertGroups, stacks: ExpertStacks, swiglu_limit: float | None,
                route_before_w2: bool, out: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
        """Every row of `groups` through its expert; writes fp32 rows of `out` [*, D] (rows not named are
        left alone). hidden [T, D] fp32 or bf16; `swiglu_limit` None (or 0) means no clamp, as `_swiglu`."""
        hidden = _activations(hidden)
        num_in = hidden.shape[1]
        if stacks.hidden_size != num_in or out.shape[1] != num_in or out.dtype != torch.float32 or not out.is_contiguous():
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
            int(route_before_w2), out.data_ptr(), self._threads(num_threads))
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
    """The library for `config` (default: the system compiler, no extra flags); raises NativeBuildError."""
    if config is None:
        compiler = find_compiler()
        if compiler is None:
            raise NativeBuildError("no C compiler found ($CC, cc, gcc, clang)")
        config = BuildConfig(compiler)
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
