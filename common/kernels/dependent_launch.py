"""Programmatic dependent launch (Hopper): a kernel starts while the kernel before it drains.

Legend: N the kernel now running on the stream, N + 1 the next one.

A decode step is a chain of short kernels, each of which needs the one before it to finish. Launched
plainly, N + 1's programs are only scheduled once the last program of N has exited and its memory
is flushed, so every boundary pays the launch, the tail of N and the ramp of N + 1. Launched with
the programmatic-serialization attribute (`launch_pdl`), N + 1 is scheduled as soon as every program
of N has signalled (`gdc_launch_dependents`) and waits on the device (`gdc_wait`, which returns once
N has completed and its writes are visible) before it touches anything N writes. The rule each
kernel here keeps: `wait_for_inputs` is its first statement (before any load of activations, routing
or counters and before any store), so the only work ahead of the wait is address arithmetic and, in
the weight-streaming kernels (FP8 linear, gate, compressor/indexer projections), a bulk L2 prefetch of
their own weight rows (`prefetch_rows_to_l2`: weights are never written, so this is safe while the
previous kernel runs); the signal follows the wait, so the next kernel is scheduled while this one
computes. The order of
results is unchanged: every kernel still sees all of its predecessor's writes, transitively, since
N + 1 cannot complete before N has.

Kernels launched without the attribute (torch's own, cuBLAS, the mailbox spin-waits) keep the plain
ordering on both sides. CUDA graphs capture dependent launches as programmatic edges.

Switch: MOEMESH_DEPENDENT_LAUNCH=1 turns it on (sm_90 or newer, NVIDIA, compiled kernels), `no-prefetch`
turns it on without the weight prefetch, `wait-only` launches with the attribute but never signals early (N + 1
is scheduled as N's programs exit, its launch already processed; no weight prefetch), unset or 0 launches
plainly. It is off by default: measured by `bench/device/dependent-launch.sh` on an H100 (docs/performance.md),
signalling after the wait makes a decode layer 15-20 % slower at one token and `wait-only` is within 1 % of plain
launches. The compiled kernels' order of wait, signal and loads is checked without a GPU
(tests/test_kernels_compile_sm90.py).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV_SWITCH = "MOEMESH_DEPENDENT_LAUNCH"


@functools.cache
def _device_supports(device_index: int) -> bool:
    """NVIDIA sm_90 or newer (ROCm builds report their own architecture numbers through the same call)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (9, 0)


def _switch(device: torch.device) -> str | None:
    """The switch's value where kernels on `device` launch as programmatic dependents ("1", "no-prefetch",
    "wait-only"), else None (unset or 0, not CUDA, the interpreter, before sm_90)."""
    value = os.environ.get(ENV_SWITCH, "0")
    if value not in ("1", "no-prefetch", "wait-only") or device.type != "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return value if _device_supports(index) else None


def dependent_launch_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents (read at each launch; cheap)."""
    return _switch(device) is not None


def weight_prefetch_enabled(device: torch.device) -> bool:
    """Whether weight-streaming kernels prefetch their weight rows into L2 ahead of the wait
    (`MOEMESH_DEPENDENT_LAUNCH=no-prefetch` keeps the dependent launch without it, for measuring)."""
    return _switch(device) == "1"


def weight_rows_prefetchable(device: torch.device, weights, *byte_offsets: int) -> bool:
    """Whether a launch on `device` prefetches rows of `weights` (`prefetch_rows_to_l2`): the prefetch is on and
    every start it issues is 16-byte aligned: each weight's base and row stride, and `byte_offsets` (the row
    spans and split starts, in bytes). None entries of `weights` are skipped."""
    return weight_prefetch_enabled(device) and all(offset % 16 == 0 for offset in byte_offsets) and all(
        w.data_ptr() % 16 == 0 and (w.stride(0) * w.element_size()) % 16 == 0 for w in weights if w is not None)


SIGNAL_AFTER_WAIT = 1  # USE_PDL values: wait, then let the next kernel be scheduled
WAIT_ONLY = 2  # wait; the next kernel is scheduled as this one's programs exit


def dependent_launch(device: torch.device) -> dict:
    """Launch keywords for a kernel that calls `wait_for_inputs(USE_PDL)` first: the attribute and the mode."""
    switch = _switch(device)
    if switch is None:
        return {}
    return {"launch_pdl": True, "USE_PDL": WAIT_ONLY if switch == "wait-only" else SIGNAL_AFTER_WAIT}


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """The kernel's first statement: wait until the previous kernel's writes are visible, then (USE_PDL 1 or
    True, `SIGNAL_AFTER_WAIT`) let the next kernel be scheduled. Nothing without USE_PDL (plain launches, the
    interpreter)."""
    if USE_PDL:
        gdc_wait()
        if USE_PDL == 1:
            gdc_launch_dependents()


@triton.jit
def prefetch_rows_to_l2(row_ptrs, num_bytes, mask):
    """Bulk-prefetch `num_bytes` bytes from each of `row_ptrs` into L2 where `mask` (sm_90
    `cp.async.bulk.prefetch.L2`): a weight-streaming kernel issues it for its own weight rows before
    `wait_for_inputs`, so that their bytes move while the previous kernel drains. The pointers must
    be 16-byte aligned and `num_bytes` a multiple of 16; weights only (never data a predecessor writes).
    """
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [row_ptrs, num_bytes, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )
