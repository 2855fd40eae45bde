"""Grouped MoE expert matmuls over rows sorted by expert, weights dequantised in the kernel.

Legend: R routed rows (token copies, sorted by expert), E experts, D hidden (4096),
I expert width (2048), BM rows per tile, BN output features per tile, BK input features per step.

Two launches per expert layer (docs/model.md §2.9):
1. `grouped_gate_up`: h = silu(min(x W1^T, limit)) * clamp(x W3^T, -limit, limit) -> [R, I], with
   both products accumulated in one program (same x tile, two weight tiles) and the SwiGLU and
   clamps applied in the epilogue; `swiglu_limit=None` skips the clamps (shared expert, ref.).
2. `grouped_down`: y = h W2^T -> [R, D], optionally times a per-row routing weight.
Rows may be addressed through indices instead of copies: gate-up reads row r of x at `x_row_ids[r]`
(the token a routed row copies) and down writes row r at `out_row_ids[r]` (its slot t·K + k), zeros
for the rows past every expert's (masked slots). Between the two, h travels k-quartered when down
decodes with ASM_QUAD at 128-wide K steps (`quartered_handoff`): within each 128-column block, column
4j + r sits at r·32 + j, so down loads the four k-mod-4 quarters its four dots take as contiguous
tiles, straight into the dots' shared-memory operand (no split of x in registers, no store to shared
memory and fence per dot); the products and their order are unchanged, so are the results.

The kernel itself is `fp4_experts_kernel.py`; this module checks shapes, picks configs and launches it.

Weights are stacked over experts: FP4 (routed experts) [E, N, K/2] bytes + ue8m0 [E, N, K/32], or
FP8 [E, N, K] e4m3 + ue8m0 [E, ceil(N/128), ceil(K/128)] (the `--expert-dtype fp8` layout, and the
shared expert as E = 1).

Scheduling without a host sync: rows of expert e are `expert_offsets[e] : expert_offsets[e+1]`;
each expert is cut into ceil(rows / BM) row tiles, and program (tile_id, n_tile) finds its expert
by a prefix sum over all experts' tile counts, done in the kernel (E <= a few hundred, one
vector load). The grid has `min(R, ceil(R / BM) + E)` tile slots, an upper bound on the real tile
count; programs past the real count return at once, before reading any weight. Each weight tile
is therefore read once per row tile of its expert: once in decode (a few rows per expert).

How a K step meets the weights is a config choice (`expert_configs.Fp4Decode`: portable fp32
decodes the interpreter runs, inline-PTX bf16 decodes for the GPU; the default is the fastest
measured, `expert_configs.choose_grouped_config`). `split_k` > 1 spreads each tile's K loop over
several programs of the same launch, the last of which sums the partials and runs the epilogue
(`split_k.py`): one launch, deterministic, graph-capturable.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch
import triton

from moemesh.common.kernels.dependent_launch import dependent_launch
from moemesh.common.kernels.expert_configs import Fp4Decode, GroupedGemmConfig, choose_grouped_config, validate
from moemesh.common.kernels.expert_rows import QUARTER_BLOCK
from moemesh.common.kernels.fp4_experts_kernel import _grouped_kernel  # the launch name tests and profiles read
from moemesh.common.kernels.reference import FP4_BLOCK_SIZE, FP8_BLOCK_SIZE, scale_bytes
from moemesh.common.kernels.split_k import tile_counters

__all__ = [
    "ExpertWeights", "Fp4Decode", "GroupedGemmConfig", "WeightFormat", "choose_grouped_config",
    "grouped_down", "grouped_experts", "grouped_gate_up", "quartered_handoff",
]


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
    config: GroupedGemmConfig, x_row_ids: torch.Tensor | None = None, out_row_ids: torch.Tensor | None = None,
    x_quartered: bool = False, out_quartered: bool = False,
) -> torch.Tensor:
    num_rows = _num_rows(x, x_row_ids)
    in_features = x.shape[1]
    for name, row_ids in (("x_row_ids", x_row_ids), ("out_row_ids", out_row_ids)):
        if row_ids is not None and (row_ids.shape != (num_rows,) or row_ids.stride(0) != 1):
            raise ValueError(f"{name} must be contiguous [{num_rows}], got {tuple(row_ids.shape)}")
    num_experts, out_features = w_a.shape[0], w_a.shape[1]
    validate(config, in_features=in_features, is_fp4=weight_format == WeightFormat.FP4_E2M1,
             x_is_bf16=x.dtype == torch.bfloat16)
    if expert_offsets.shape != (num_experts + 1,):
        raise ValueError(f"expert_offsets must have {num_experts + 1} entries, got {tuple(expert_offsets.shape)}")
    if x_quartered and not _reads_quartered(config, weight_format, in_features):
        raise ValueError(f"k-quartered x needs FP4 weights, ASM_QUAD and block_k {QUARTER_BLOCK.value}, "
                         f"got {config.short()}")
    if out_quartered and out_features % QUARTER_BLOCK.value:
        raise ValueError(f"k-quartered output needs a multiple of {QUARTER_BLOCK.value} features, got {out_features}")
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
    num_groups = num_experts + (out_row_ids is not None)  # rows without an expert: one more group of tiles
    max_tiles = min(num_rows, triton.cdiv(num_rows, config.block_m) + num_groups)
    grid = (max_tiles, triton.cdiv(out_features, config.block_n), config.split_k)
    if config.split_k > 1:
        num_parts = 2 if fuse else 1
        partials = torch.empty(config.split_k, num_rows, num_parts * out_features, dtype=torch.float32,
                               device=x.device)
        counters = tile_counters(x.device, grid[0] * grid[1])
    else:
        partials, counters = out, offsets  # never read
    _grouped_kernel[grid](
        x, w_a_bytes, s_a_bytes, w_b_bytes, s_b_bytes, out, offsets,
        row_weights if row_weights is not None else out, partials, counters,
        num_experts, out_features, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        x.stride(0), w_a_bytes.stride(0), w_a_bytes.stride(1), s_a_bytes.stride(0), s_a_bytes.stride(1), out.stride(0),
        partials.stride(0) if config.split_k > 1 else 0,
        IN_FEATURES=in_features, WEIGHT_FORMAT=int(weight_format), FP4_DECODE=int(config.fp4_decode),
        FUSE_SWIGLU=fuse, HAS_LIMIT=swiglu_limit is not None, HAS_ROW_WEIGHTS=row_weights is not None,
        SPLIT_K=config.split_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        x_rows_ptr=x_row_ids, out_rows_ptr=out_row_ids, num_rows=num_rows if out_row_ids is not None else None,
        X_QUARTERED=x_quartered, OUT_QUARTERED=out_quartered,
        num_warps=config.num_warps, num_stages=config.num_stages, **dependent_launch(x.device),
    )
    return out


def _num_rows(x: torch.Tensor, x_row_ids: torch.Tensor | None) -> int:
    """R: the rows a launch computes (x's rows, or one per entry of x_row_ids)."""
    return x.shape[0] if x_row_ids is None else x_row_ids.shape[0]


def _default_config(x: torch.Tensor, weights: ExpertWeights, out_features: int,
                    num_rows: int | None = None) -> GroupedGemmConfig:
    return _config_for(x.shape[0] if num_rows is None else num_rows, x.shape[1], out_features, x.dtype, x.device,
                       weights)


def _config_for(num_rows: int, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device,
                weights: ExpertWeights) -> GroupedGemmConfig:
    config = choose_grouped_config(num_rows, weights.num_experts, out_features=out_features,
                                   x_is_bf16=dtype == torch.bfloat16,
                                   is_fp4=weights.weight_format == WeightFormat.FP4_E2M1, num_sms=_num_sms(device))
    # The K loop must split evenly; a width that does not (never at V4-Flash sizes) runs unsplit.
    if (in_features // config.block_k) % config.split_k:
        config = dataclasses.replace(config, split_k=1)
    return config


def _reads_quartered(config: GroupedGemmConfig, weight_format: WeightFormat, in_features: int) -> bool:
    return (weight_format == WeightFormat.FP4_E2M1 and config.fp4_decode == Fp4Decode.ASM_QUAD
            and config.block_k == QUARTER_BLOCK.value and in_features % QUARTER_BLOCK.value == 0)


def quartered_handoff(num_rows: int, weights: ExpertWeights, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether gate-up hands its SwiGLU rows to down k-quartered: when down's default launch over
    `num_rows` rows decodes with ASM_QUAD at QUARTER_BLOCK-wide K steps (decode and short prefill on the
    GPU). Down then loads each quarter of a K step as one contiguous tile (no split of x in registers);
    the products and their order are ASM_QUAD's, so the results are the same bits."""
    config = _config_for(num_rows, weights.intermediate_size, weights.hidden_size, dtype, device, weights)
    return _reads_quartered(config, weights.weight_format, weights.intermediate_size)


def _num_sms(device: torch.device) -> int:
    from moemesh.common.kernels.fp8_linear_config import device_num_sms

    return device_num_sms(device)


def grouped_gate_up(
    x_sorted: torch.Tensor, expert_offsets: torch.Tensor, weights: ExpertWeights, *,
    swiglu_limit: float | None, out_dtype: torch.dtype | None = None, config: GroupedGemmConfig | None = None,
    x_row_ids: torch.Tensor | None = None, quartered_out: bool = False,
) -> torch.Tensor:
    """x_sorted [R, D] -> SwiGLU hidden [R, I] in `out_dtype` (default x's dtype).

    With `x_row_ids` [R] int32, x_sorted is any [T, D] and row r reads x_sorted[x_row_ids[r]] (no
    gathered copy of x); the launch, and every row's result, is that of `x_sorted[x_row_ids]`.
    With `quartered_out` the rows come k-quartered (`expert_rows.quarter_columns`), for
    `grouped_down(hidden_quartered=True)`."""
    num_rows = _num_rows(x_sorted, x_row_ids)
    config = config or _default_config(x_sorted, weights, weights.intermediate_size, num_rows)
    return _launch(
        x_sorted, expert_offsets, weights.w1, weights.s1, weights.w3, weights.s3, weights.weight_format,
        swiglu_limit=swiglu_limit, row_weights=None, out_dtype=out_dtype or x_sorted.dtype, config=config,
        x_row_ids=x_row_ids, out_quartered=quartered_out,
    )


def grouped_down(
    hidden: torch.Tensor, expert_offsets: torch.Tensor, weights: ExpertWeights, *,
    row_weights: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    config: GroupedGemmConfig | None = None, out_row_ids: torch.Tensor | None = None,
    hidden_quartered: bool = False, x_row_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [R, I] -> [R, D], each row times `row_weights[r]` (fp32 [R]) when given; `hidden_quartered`:
    hidden's rows are k-quartered (`grouped_gate_up(quartered_out=True)`, see `quartered_handoff`).
    With `x_row_ids` [R] int32, row r reads hidden[x_row_ids[r]] (as `grouped_gate_up`'s).

    With `out_row_ids` [R] int32 (a permutation of 0..R-1), row r's result goes to output row
    out_row_ids[r] (the sorted-order result scattered in the same launch); rows r from expert_offsets[E]
    on have no expert: their output rows come out as exact zeros, without reading `hidden`. Every
    output row is written."""
    config = config or _default_config(hidden, weights, weights.w2.shape[1], _num_rows(hidden, x_row_ids))
    return _launch(
        hidden, expert_offsets, weights.w2, weights.s2, None, None, weights.weight_format,
        swiglu_limit=None, row_weights=row_weights, out_dtype=out_dtype or hidden.dtype, config=config,
        x_row_ids=x_row_ids, out_row_ids=out_row_ids, x_quartered=hidden_quartered,
    )


def grouped_experts(
    x_sorted: torch.Tensor, expert_offsets: torch.Tensor, weights: ExpertWeights, *,
    swiglu_limit: float | None, row_weights: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The whole routed-expert computation for rows sorted by expert: [R, D] -> [R, D]."""
    quartered = quartered_handoff(x_sorted.shape[0], weights, x_sorted.dtype, x_sorted.device)
    hidden = grouped_gate_up(x_sorted, expert_offsets, weights, swiglu_limit=swiglu_limit, quartered_out=quartered)
    return grouped_down(hidden, expert_offsets, weights, row_weights=row_weights, out_dtype=out_dtype,
                        hidden_quartered=quartered)
