"""Grouped MoE expert matmuls over rows sorted by expert, weights dequantised in the kernel.

Legend: R routed rows (token copies, sorted by expert), E experts, D hidden (4096),
I expert width (2048), BM rows per tile, BN output features per tile, BK input features per step.

Two launches per expert layer (spec §2.9):
1. `grouped_gate_up`: h = silu(min(x W1^T, limit)) * clamp(x W3^T, -limit, limit) -> [R, I], with
   both products accumulated in one program (same x tile, two weight tiles) and the SwiGLU and
   clamps applied in the epilogue; `swiglu_limit=None` skips the clamps (shared expert, ref.).
2. `grouped_down`: y = h W2^T -> [R, D], optionally times a per-row routing weight.

Weights are stacked over experts: FP4 (routed experts) [E, N, K/2] bytes + ue8m0 [E, N, K/32], or
FP8 [E, N, K] e4m3 + ue8m0 [E, ceil(N/128), ceil(K/128)] (the `--expert-dtype fp8` layout, and the
shared expert as E = 1).

Scheduling without a host sync: rows of expert e are `expert_offsets[e] : expert_offsets[e+1]`;
each expert is cut into ceil(rows / BM) row tiles, and program (tile_id, n_tile) finds its expert
by a prefix sum over all experts' tile counts, done in the kernel (E <= a few hundred, one
vector load). The grid has `min(R, ceil(R / BM) + E)` tile slots, an upper bound on the real tile
count; programs past the real count return at once, before reading any weight. Each weight tile
is therefore read once per row tile of its expert: once in decode (a few rows per expert).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.kernels.dequant_tiles import fp4_tile, fp8_tile
from common.kernels.reference import FP4_BLOCK_SIZE, FP8_BLOCK_SIZE, scale_bytes


class WeightFormat(enum.IntEnum):
    FP4_E2M1 = 0  # packed [E, N, K/2], scale [E, N, K/32]
    FP8_E4M3 = 1  # [E, N, K], scale [E, ceil(N/128), ceil(K/128)]


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's experts, stacked. w1/w3: gate/up [E, I, ...]; w2: down [E, D, ...]."""

    w1: torch.Tensor
    s1: torch.Tensor
    w3: torch.Tensor
    s3: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    weight_format: WeightFormat

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w1.shape[1]


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tile shape and launch parameters; `block_k` is a multiple of 32 dividing 128."""

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_k % FP4_BLOCK_SIZE != 0 or FP8_BLOCK_SIZE % self.block_k != 0:
            raise ValueError(f"block_k {self.block_k} must be a multiple of 32 dividing 128")
        if min(self.block_m, self.block_n) < 16:
            raise ValueError("block_m and block_n must be at least 16 (tl.dot)")


def choose_grouped_config(num_rows: int, num_experts: int) -> GroupedGemmConfig:
    """Decode (a few rows per expert): narrow tiles so that enough programs stream the weights.
    Prefill (tens of rows per expert or more): larger tiles that reuse each weight tile."""
    mean_rows_per_expert = num_rows / max(1, num_experts)
    # Tile shapes are the best measured on an H200 (bench/NOTES.md), same for both launches.
    if mean_rows_per_expert >= 32:
        return GroupedGemmConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    block_m = 16 if mean_rows_per_expert <= 4 else 32
    return GroupedGemmConfig(block_m=block_m, block_n=64, block_k=128, num_warps=4, num_stages=3)


@triton.jit
def _find_tile(offsets_ptr, tile_id, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of row tile `tile_id`; expert >= num_experts if there is none."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    row_lo = tl.load(offsets_ptr + experts, mask=valid, other=0)  # [BE]
    row_hi = tl.load(offsets_ptr + experts + 1, mask=valid, other=0)  # [BE]
    num_tiles = (row_hi - row_lo + BLOCK_M - 1) // BLOCK_M  # [BE]
    tiles_through = tl.cumsum(num_tiles, 0)  # [BE] inclusive prefix sum
    expert = tl.sum((tiles_through <= tile_id).to(tl.int32), 0)
    mine = experts == expert
    tiles_before = tl.sum(tl.where(mine, tiles_through - num_tiles, 0), 0)
    row_begin = tl.sum(tl.where(mine, row_lo, 0), 0) + (tile_id - tiles_before) * BLOCK_M
    row_end = tl.sum(tl.where(mine, row_hi, 0), 0)
    return expert, row_begin, row_end


@triton.jit
def _weight_tile(w_ptr, s_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, stride_sn,
                 WEIGHT_FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if WEIGHT_FORMAT == 0:
        return fp4_tile(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_N, BLOCK_K)
    else:
        return fp8_tile(w_ptr, s_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, stride_sn, BLOCK_K)


@triton.jit
def _grouped_kernel(
    x_ptr, wa_ptr, sa_ptr, wb_ptr, sb_ptr, out_ptr, offsets_ptr, row_weights_ptr,
    num_experts, out_features, swiglu_limit,
    stride_xr, stride_we, stride_wn, stride_se, stride_sn, stride_or,
    IN_FEATURES: tl.constexpr, WEIGHT_FORMAT: tl.constexpr, FUSE_SWIGLU: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_ROW_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    tile_id = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, row_begin, row_end = _find_tile(offsets_ptr, tile_id, num_experts, BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        return
    offs_m = row_begin + tl.arange(0, BLOCK_M)  # [BM]
    mask_m = offs_m < row_end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < out_features
    expert64 = expert.to(tl.int64)
    wa_ptr += expert64 * stride_we
    sa_ptr += expert64 * stride_se
    wb_ptr += expert64 * stride_we
    sb_ptr += expert64 * stride_se
    offs_k = tl.arange(0, BLOCK_K)

    acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # (x W_a^T)^T tile
    acc_b = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # (x W_b^T)^T tile, SwiGLU only
    for step in range(0, IN_FEATURES // BLOCK_K):
        k_begin = step * BLOCK_K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xr + (k_begin + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
        x_t = tl.trans(x)  # [BK, BM]
        w_a = _weight_tile(wa_ptr, sa_ptr, offs_n, mask_n, k_begin, IN_FEATURES, stride_wn, stride_sn,
                           WEIGHT_FORMAT, BLOCK_N, BLOCK_K)
        acc_a = tl.dot(w_a.to(x.dtype), x_t, acc_a)
        if FUSE_SWIGLU:
            w_b = _weight_tile(wb_ptr, sb_ptr, offs_n, mask_n, k_begin, IN_FEATURES, stride_wn, stride_sn,
                               WEIGHT_FORMAT, BLOCK_N, BLOCK_K)
            acc_b = tl.dot(w_b.to(x.dtype), x_t, acc_b)

    if FUSE_SWIGLU:
        gate = acc_a
        up = acc_b
        if HAS_LIMIT:
            gate = tl.minimum(gate, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        result = gate * tl.sigmoid(gate) * up
    else:
        result = acc_a
    if HAS_ROW_WEIGHTS:
        row_weight = tl.load(row_weights_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        result = result * row_weight[None, :]
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_or + offs_n[:, None]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def _check_weight(w: torch.Tensor, s: torch.Tensor, weight_format: WeightFormat, num_cols: int) -> None:
    num_experts, num_rows = w.shape[0], w.shape[1]
    if weight_format == WeightFormat.FP4_E2M1:
        expected_w = (num_experts, num_rows, num_cols // 2)
        expected_s = (num_experts, num_rows, num_cols // FP4_BLOCK_SIZE)
    else:
        expected_w = (num_experts, num_rows, num_cols)
        expected_s = (num_experts, -(-num_rows // FP8_BLOCK_SIZE), -(-num_cols // FP8_BLOCK_SIZE))
    if tuple(w.shape) != expected_w or tuple(s.shape) != expected_s:
        raise ValueError(f"{weight_format.name}: weight {tuple(w.shape)} / scale {tuple(s.shape)}, "
                         f"expected {expected_w} / {expected_s}")
    if not (w.is_contiguous() and s.is_contiguous()):
        raise ValueError("expert weights and scales must be contiguous")


def _launch(
    x: torch.Tensor, expert_offsets: torch.Tensor, w_a: torch.Tensor, s_a: torch.Tensor,
    w_b: torch.Tensor | None, s_b: torch.Tensor | None, weight_format: WeightFormat, *,
    swiglu_limit: float | None, row_weights: torch.Tensor | None, out_dtype: torch.dtype,
    config: GroupedGemmConfig,
) -> torch.Tensor:
    num_rows, in_features = x.shape
    num_experts, out_features = w_a.shape[0], w_a.shape[1]
    if in_features % config.block_k != 0:
        raise ValueError(f"in_features {in_features} must be a multiple of block_k {config.block_k}")
    if expert_offsets.shape != (num_experts + 1,):
        raise ValueError(f"expert_offsets must have {num_experts + 1} entries, got {tuple(expert_offsets.shape)}")
    _check_weight(w_a, s_a, weight_format, in_features)
    fuse = w_b is not None
    if fuse:
        _check_weight(w_b, s_b, weight_format, in_features)
    w_a_bytes = w_a.view(torch.uint8)
    s_a_bytes = scale_bytes(s_a)
    w_b_bytes = w_b.view(torch.uint8) if fuse else w_a_bytes
    s_b_bytes = scale_bytes(s_b) if fuse else s_a_bytes
    x = x if x.stride(-1) == 1 else x.contiguous()
    offsets = expert_offsets.to(torch.int32)
    out = torch.empty(num_rows, out_features, dtype=out_dtype, device=x.device)
    if num_rows == 0:
        return out
    max_tiles = min(num_rows, triton.cdiv(num_rows, config.block_m) + num_experts)
    grid = (max_tiles, triton.cdiv(out_features, config.block_n))
    _grouped_kernel[grid](
        x, w_a_bytes, s_a_bytes, w_b_bytes, s_b_bytes, out, offsets,
        row_weights if row_weights is not None else out,
        num_experts, out_features, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        x.stride(0), w_a_bytes.stride(0), w_a_bytes.stride(1), s_a_bytes.stride(0), s_a_bytes.stride(1), out.stride(0),
        IN_FEATURES=in_features, WEIGHT_FORMAT=int(weight_format), FUSE_SWIGLU=fuse,
        HAS_LIMIT=swiglu_limit is not None, HAS_ROW_WEIGHTS=row_weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def grouped_gate_up(
    x_sorted: torch.Tensor, expert_offsets: torch.Tensor, weights: ExpertWeights, *,
    swiglu_limit: float | None, out_dtype: torch.dtype | None = None, config: GroupedGemmConfig | None = None,
) -> torch.Tensor:
    """x_sorted [R, D] -> SwiGLU hidden [R, I] in `out_dtype` (default x's dtype)."""
    config = config or choose_grouped_config(x_sorted.shape[0], weights.num_experts)
    return _launch(
        x_sorted, expert_offsets, weights.w1, weights.s1, weights.w3, weights.s3, weights.weight_format,
        swiglu_limit=swiglu_limit, row_weights=None, out_dtype=out_dtype or x_sorted.dtype, config=config,
    )


def grouped_down(
    hidden: torch.Tensor, expert_offsets: torch.Tensor, weights: ExpertWeights, *,
    row_weights: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    config: GroupedGemmConfig | None = None,
) -> torch.Tensor:
    """hidden [R, I] -> [R, D], each row times `row_weights[r]` (fp32 [R]) when given."""
    config = config or choose_grouped_config(hidden.shape[0], weights.num_experts)
    return _launch(
        hidden, expert_offsets, weights.w2, weights.s2, None, None, weights.weight_format,
        swiglu_limit=None, row_weights=row_weights, out_dtype=out_dtype or hidden.dtype, config=config,
    )


def grouped_experts(
    x_sorted: torch.Tensor, expert_offsets: torch.Tensor, weights: ExpertWeights, *,
    swiglu_limit: float | None, row_weights: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The whole routed-expert computation for rows sorted by expert: [R, D] -> [R, D]."""
    hidden = grouped_gate_up(x_sorted, expert_offsets, weights, swiglu_limit=swiglu_limit)
    return grouped_down(hidden, expert_offsets, weights, row_weights=row_weights, out_dtype=out_dtype)
