"""Routed experts at prefill sizes: dequantise a chunk of FP4 experts to bf16, then grouped GEMMs.

Legend: R routed rows (sorted by expert), E experts, D hidden, I expert width, C experts per chunk.

Why: the fused grouped kernel (`fp4_experts`) decodes every weight tile once per row tile of its
expert, in the GEMM's main loop; at an 8K-token prefill an expert sees ~190 rows, so each tile is
decoded three times (64-row tiles) and the decode competes with the MMA for issue slots (measured:
184 TFLOP/s, 26 % of the bf16 rate at 2K tokens). Here each weight is decoded exactly once, by a
bandwidth-bound kernel (FP4 read + bf16 written: ~4.3x the FP4 bytes), and the GEMMs are
`torch._grouped_mm` (CUTLASS grouped GEMM on Hopper) on plain bf16 operands. That costs a transient
bf16 copy of C experts (bounded by `max_scratch_bytes`) and one host sync per call (the chunk row
ranges): prefill only, never in a captured decode step. Worth it only when experts see many rows;
`prefer_dequant_path` says when (measured on the H200, docs/performance.md).

Numerics: gate and up come back from the GEMM rounded to bf16 (grouped_mm has no fp32 output), the
SwiGLU runs in fp32 and rounds once, the down product is rounded to bf16 and then scaled by the row
weight in fp32 (one more rounding): the torch path's roundings, one more than the fused kernel's.
The model is never dequantised as a whole: at most one chunk of one layer exists in bf16 at a time.
"""

from __future__ import annotations

import enum
import os

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dequant_tiles import fp4_tile

DEQUANT_BLOCK_N = 32
DEQUANT_BLOCK_K = 256
DEFAULT_MAX_SCRATCH_BYTES = 1 << 30
MIN_MEAN_ROWS_PER_EXPERT = 128  # below this the fused kernel wins (placeholder until measured: NOTES)


@triton.jit
def _dequant_fp4_kernel(w_ptr, s_ptr, out_ptr, num_rows, stride_we, stride_wn, stride_se, stride_sn,
                        stride_oe, stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BN, BK] tile of one expert: FP4 + ue8m0 -> bf16 (exact: e2m1 x 2^k fits bf16)."""
    num_n_tiles = tl.cdiv(num_rows, BLOCK_N)
    pid = tl.program_id(0)
    expert = (pid // num_n_tiles).to(tl.int64)  # int64: a chunk's bf16 output passes 2^31 elements
    offs_n = (pid % num_n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < num_rows
    k_begin = tl.program_id(1) * BLOCK_K
    tile = fp4_tile(w_ptr + expert * stride_we, s_ptr + expert * stride_se, offs_n, mask_n, k_begin,
                    stride_wn, stride_sn, BLOCK_N, BLOCK_K)  # [BN, BK] fp32
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    out_ptrs = out_ptr + expert * stride_oe + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :]
    tl.store(out_ptrs, tile.to(tl.bfloat16), mask=mask_n[:, None])


def dequant_fp4_experts(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """w packed [C, N, K/2] uint8, s ue8m0 [C, N, K/32] -> `out` bf16 [C, N, K] (any row stride, unit
    column stride: it may be a slice of a wider buffer, e.g. the up half of a gate-up buffer)."""
    num_experts, num_rows, half_k = w.shape
    num_cols = 2 * half_k
    if tuple(out.shape) != (num_experts, num_rows, num_cols) or out.stride(-1) != 1 or out.dtype != torch.bfloat16:
        raise ValueError(f"out must be bf16 [{num_experts}, {num_rows}, {num_cols}] with unit column stride")
    if num_cols % DEQUANT_BLOCK_K:
        raise ValueError(f"K={num_cols} must be a multiple of {DEQUANT_BLOCK_K}")
    w_bytes = w.view(torch.uint8)
    s_bytes = s.view(torch.uint8)
    grid = (num_experts * triton.cdiv(num_rows, DEQUANT_BLOCK_N), num_cols // DEQUANT_BLOCK_K)
    _dequant_fp4_kernel[grid](w_bytes, s_bytes, out, num_rows, w_bytes.stride(0), w_bytes.stride(1),
                              s_bytes.stride(0), s_bytes.stride(1), out.stride(0), out.stride(1),
                              BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K, num_warps=4)
    return out


PREFILL_PATH_ENV = "MOEMESH_EXPERT_PREFILL"


class PrefillPath(enum.Enum):
    """Which routed-expert path runs on CUDA for bf16 rows (`MOEMESH_EXPERT_PREFILL`, read per call so
    a benchmark can compare both in one process)."""

    FUSED = "fused"  # always the fused grouped kernel (`fp4_experts`)
    DEQUANT = "dequant"  # this module wherever it can run (FP4, bf16, torch._grouped_mm)
    AUTO = "auto"  # this module when `prefer_dequant_path` says so


DEFAULT_PREFILL_PATH = PrefillPath.FUSED  # measured faster than `dequant` below ~20K tokens (docs/performance.md)


def prefill_path() -> PrefillPath:
    value = os.environ.get(PREFILL_PATH_ENV, "").strip().lower()
    return PrefillPath(value) if value else DEFAULT_PREFILL_PATH


def prefer_dequant_path(num_rows: int, num_experts: int) -> bool:
    """Host-side rule: many rows per expert (a long prefill) and a grouped GEMM in this torch."""
    return num_rows >= MIN_MEAN_ROWS_PER_EXPERT * num_experts and hasattr(torch, "_grouped_mm")


def use_dequant_path(num_rows: int, num_experts: int) -> bool:
    """The dispatch decision for one call (host integers only: no sync, capture-safe when False)."""
    path = prefill_path()
    if (path is PrefillPath.FUSED or num_rows == 0 or not hasattr(torch, "_grouped_mm")
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):  # it syncs the host
        return False
    return path is PrefillPath.DEQUANT or prefer_dequant_path(num_rows, num_experts)


def _swiglu_bf16(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """gate_up [R, 2I] bf16 -> silu(min(gate, limit)) * clamp(up, ±limit) [R, I] bf16, math in fp32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)


def grouped_experts_dequant(x_sorted: torch.Tensor, expert_offsets: torch.Tensor, weights, *,
                            swiglu_limit: float | None, row_weights: torch.Tensor | None = None,
                            max_scratch_bytes: int = DEFAULT_MAX_SCRATCH_BYTES) -> torch.Tensor:
    """`fp4_experts.grouped_experts` for FP4 weights and bf16 rows: x_sorted [R, D] -> [R, D] bf16.

    Experts go in chunks whose bf16 gate-up and down copies fit `max_scratch_bytes`; empty chunks
    are skipped. One `expert_offsets.tolist()` (host sync) per call."""
    from moemesh.common.kernels.fp4_experts import WeightFormat

    if weights.weight_format != WeightFormat.FP4_E2M1 or x_sorted.dtype != torch.bfloat16:
        raise ValueError("the dequantise path takes FP4 weights and bf16 rows")
    num_experts, inter, hidden = weights.num_experts, weights.intermediate_size, weights.hidden_size
    bytes_per_expert = 2 * (2 * inter * hidden + hidden * inter)
    chunk = max(1, min(num_experts, max_scratch_bytes // bytes_per_expert))
    device = x_sorted.device
    gate_up_w = torch.empty(chunk, 2 * inter, hidden, dtype=torch.bfloat16, device=device)  # [C, 2I, D]
    down_w = torch.empty(chunk, hidden, inter, dtype=torch.bfloat16, device=device)  # [C, D, I]
    offsets = expert_offsets.to(device=device, dtype=torch.int32)
    bounds = offsets.tolist()
    out = torch.empty(x_sorted.shape[0], hidden, dtype=torch.bfloat16, device=device)
    for first in range(0, num_experts, chunk):
        last = min(num_experts, first + chunk)
        row_begin, row_end = bounds[first], bounds[last]
        if row_begin == row_end:
            continue
        count = last - first
        dequant_fp4_experts(weights.w1[first:last], weights.s1[first:last], gate_up_w[:count, :inter])
        dequant_fp4_experts(weights.w3[first:last], weights.s3[first:last], gate_up_w[:count, inter:])
        dequant_fp4_experts(weights.w2[first:last], weights.s2[first:last], down_w[:count])
        ends = offsets[first + 1:last + 1] - row_begin  # [C] int32: cumulative row ends within the chunk
        rows = x_sorted[row_begin:row_end]
        gate_up = torch._grouped_mm(rows, gate_up_w[:count].transpose(1, 2), offs=ends)  # [r, 2I] bf16
        hidden_rows = _swiglu_bf16(gate_up, swiglu_limit)  # [r, I]
        y = torch._grouped_mm(hidden_rows, down_w[:count].transpose(1, 2), offs=ends)  # [r, D] bf16
        if row_weights is not None:
            y = (y.float() * row_weights[row_begin:row_end, None]).to(torch.bfloat16)
        out[row_begin:row_end] = y
    return out
