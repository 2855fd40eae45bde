"""A CSA layer's compressors' and indexer's decode-size projections of one input in one launch (docs/model.md §2.5,
§2.6).

Legend: T tokens (at most DECODE_MAX_TOKENS), K input features (hidden), C compressor input width,
H indexer heads, m compression ratio, BN output features per tile, S split-K parts.

From x [T, K] and 16-bit weights of x's dtype, with every product rounded to x's dtype first, as
`F.linear` returns it, and the fp32 steps after it done as the torch code does them:
- kv [T, C] = x · Wkvᵀ (x's dtype)                                   `Compressor.project`'s K
- score [T, C] fp32 = fp32(x · Wgateᵀ) + ape[pos mod m]               its Z
- the same pair for a second compressor of the same ratio (optional)  the CSA indexer's compressor
- head weights [T, H] fp32 = fp32(x · Wprojᵀ) · scale (optional)      `Indexer`'s weights_proj(x).float() · H^-1/2
Results equal the torch code's up to the fp32 summation order of each product (cuBLAS's order against
this kernel's fixed one), i.e. within one unit in the last place of the rounded product.

Why: cuBLAS runs each of these bf16 GEMVs as a split-K kernel plus a reduction kernel, and torch then
takes the remainder, gathers `ape`, adds, casts and scales: seven launches per compressor, four for the
head weights. Here one launch per layer. The tiles cover the outputs one after the other (kv tiles,
score tiles, the second compressor's, head tiles), each program reads one weight tile per K step (the weights stay separate
tensors: no concatenated copy), computes y^T = W_tile @ x^T as `fp8_linear`'s decode schedule does, and
splits K inside the launch: the last program of a tile sums the S partials in a fixed order and runs
the epilogue (`split_k.py`). No host sync; graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dependent_launch import (
    dependent_launch, prefetch_rows_to_l2, wait_for_inputs, weight_rows_prefetchable,
)
from moemesh.common.kernels.fp8_linear_config import DECODE_MAX_TOKENS, device_num_sms
from moemesh.common.kernels.split_k import take_ticket, tile_counters

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ProjectionConfig:
    """Tile shape and launch parameters; `split_k` None: enough parts for ~2 programs per SM."""

    block_n: int = 64
    block_k: int = 128
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _projections_kernel(
    x_ptr, kv_w_ptr, score_w_ptr, kv2_w_ptr, score2_w_ptr, head_w_ptr, kv_ptr, score_ptr, kv2_ptr, score2_ptr,
    head_ptr, ape_ptr, ape2_ptr, positions_ptr, partial_ptr, counter_ptr,
    num_tokens, in_features, width, width2, num_heads, head_scale, stride_xt, stride_ps, stride_pt,
    RATIO: tl.constexpr, WIDTH_TILES: tl.constexpr, WIDTH2_TILES: tl.constexpr, SPLIT_K: tl.constexpr,
    K_STEPS_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False, PREFETCH_L2: tl.constexpr = False,
):
    # grid (2 · WIDTH_TILES + 2 · WIDTH2_TILES + head tiles, S); output segment 0: kv, 1: score, 2: kv2,
    # 3: score2 (the second compressor's), 4: head weights
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    segment = ((pid_n >= WIDTH_TILES).to(tl.int32) + (pid_n >= 2 * WIDTH_TILES).to(tl.int32)
               + (pid_n >= 2 * WIDTH_TILES + WIDTH2_TILES).to(tl.int32)
               + (pid_n >= 2 * (WIDTH_TILES + WIDTH2_TILES)).to(tl.int32))
    first_tile = tl.where(segment <= 2, segment * WIDTH_TILES, 2 * WIDTH_TILES + (segment - 2) * WIDTH2_TILES)
    segment_width = tl.where(segment <= 1, width, tl.where(segment <= 3, width2, num_heads))
    first_output = tl.where(segment <= 2, segment * width, 2 * width + (segment - 2) * width2)  # in the partials
    offs_n = (pid_n - first_tile) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] within the segment
    mask_n = offs_n < segment_width
    w_ptr = kv_w_ptr
    if segment == 1:
        w_ptr = score_w_ptr
    if segment == 2:
        w_ptr = kv2_w_ptr
    if segment == 3:
        w_ptr = score2_w_ptr
    if segment == 4:
        w_ptr = head_w_ptr
    if PREFETCH_L2:  # this program's weight rows towards L2 while the previous kernel drains
        ELEMENT_BYTES: tl.constexpr = kv_w_ptr.dtype.element_ty.primitive_bitwidth // 8
        k_first = pid_s * K_STEPS_PER_SPLIT * BLOCK_K
        span = tl.minimum(K_STEPS_PER_SPLIT * BLOCK_K, in_features - k_first)  # elements per row
        prefetch_rows_to_l2(w_ptr + offs_n.to(tl.int64) * in_features + k_first, span * ELEMENT_BYTES + offs_n * 0,
                            mask_n & (span > 0))
    wait_for_inputs(USE_PDL)
    offs_t = tl.arange(0, BLOCK_T)  # [BT]
    mask_t = offs_t < num_tokens
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)  # y^T tile
    for step in range(0, K_STEPS_PER_SPLIT):  # steps past K (last split only) load nothing
        k = (pid_s * K_STEPS_PER_SPLIT + step) * BLOCK_K + offs_k  # [BK]
        mask_k = k < in_features
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * in_features + k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BN, BK]
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + k[None, :], mask=mask_t[:, None] & mask_k[None, :],
                    other=0.0)  # [BT, BK]
        acc = tl.dot(w, tl.trans(x), acc)
    store_mask = mask_n[:, None] & mask_t[None, :]  # [BN, BT]
    if SPLIT_K > 1:
        part_offs = offs_t[None, :] * stride_pt + (first_output + offs_n)[:, None]  # [BN, BT]
        tl.store(partial_ptr + pid_s * stride_ps + part_offs, acc, mask=store_mask)
        is_last = take_ticket(counter_ptr + pid_n, SPLIT_K)
        store_mask = store_mask & is_last
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # fixed order: deterministic sum
            acc += tl.load(partial_ptr + s * stride_ps + part_offs, mask=store_mask, other=0.0, cache_modifier=".cg")

    product = acc.to(kv_ptr.dtype.element_ty)  # F.linear's rounding
    if segment == 0:
        tl.store(kv_ptr + offs_t[None, :] * width + offs_n[:, None], product, mask=store_mask)
    if segment == 2:
        tl.store(kv2_ptr + offs_t[None, :] * width2 + offs_n[:, None], product, mask=store_mask)
    if segment == 1 or segment == 3:
        out_ptr = score_ptr
        table_ptr = ape_ptr
        if segment == 3:
            out_ptr = score2_ptr
            table_ptr = ape2_ptr
        positions = tl.load(positions_ptr + offs_t, mask=mask_t, other=0)  # [BT]
        ape = tl.load(table_ptr + (positions % RATIO)[None, :] * segment_width + offs_n[:, None], mask=store_mask,
                      other=0.0)  # [BN, BT] fp32
        tl.store(out_ptr + offs_t[None, :] * segment_width + offs_n[:, None], product.to(tl.float32) + ape,
                 mask=store_mask)
    if segment == 4:
        tl.store(head_ptr + offs_t[None, :] * num_heads + offs_n[:, None], product.to(tl.float32) * head_scale,
                 mask=store_mask)


def supports(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `compressor_projections` takes this call: a decode-size 2-D x of a 16-bit dtype and
    contiguous weights of the same dtype and input width."""
    if x.dim() != 2 or not 0 < x.shape[0] <= DECODE_MAX_TOKENS or x.dtype not in SUPPORTED_DTYPES:
        return False
    return all(w.dtype == x.dtype and w.dim() == 2 and w.shape[1] == x.shape[1] and w.is_contiguous()
               for w in weights)


def compressor_projections(
    x: torch.Tensor,  # [T, K]
    kv_weight: torch.Tensor,  # [C, K]
    score_weight: torch.Tensor,  # [C, K]
    ape: torch.Tensor,  # [m, C] fp32
    positions: torch.Tensor,  # [T] int
    *,
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # ([C2, K], [C2, K], [m, C2] fp32)
    head_weight: torch.Tensor | None = None,  # [H, K]
    head_scale: float = 1.0,
    config: ProjectionConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    """-> (kv [T, C] x's dtype, score [T, C] fp32), then with `second` (another compressor of the same ratio: the
    CSA indexer's beside the layer's) its (kv [T, C2], score [T, C2]), then with `head_weight` head weights [T, H]
    fp32 (see the module docstring); one launch."""
    weights = (kv_weight, score_weight) + (second[:2] if second is not None else ()) + (
        (head_weight,) if head_weight is not None else ())
    if not supports(x, *weights):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} with weights {[tuple(w.shape) for w in weights]} "
                         f"{[w.dtype for w in weights]}: not a decode-size 16-bit projection")
    ratio = ape.shape[0]
    for kv_w, score_w, table in ((kv_weight, score_weight, ape),) + ((second,) if second is not None else ()):
        if (score_w.shape[0] != kv_w.shape[0] or tuple(table.shape) != (ratio, kv_w.shape[0])
                or table.dtype != torch.float32):
            raise ValueError(f"kv {tuple(kv_w.shape)}, score {tuple(score_w.shape)} and ape "
                             f"{tuple(table.shape)} {table.dtype} do not match (ratio {ratio})")
    config = config or ProjectionConfig()
    num_tokens, in_features = x.shape
    width = kv_weight.shape[0]
    width2 = second[0].shape[0] if second is not None else 0
    num_heads = head_weight.shape[0] if head_weight is not None else 0
    x = x if x.stride(-1) == 1 else x.contiguous()
    new = lambda columns, dtype: torch.empty(num_tokens, columns, dtype=dtype, device=x.device)  # noqa: E731
    kv, score, kv2, score2 = new(width, x.dtype), new(width, torch.float32), new(width2, x.dtype), new(width2,
                                                                                                     torch.float32)
    heads = new(num_heads, torch.float32)
    width_tiles, width2_tiles = triton.cdiv(width, config.block_n), triton.cdiv(width2, config.block_n)
    num_tiles = 2 * (width_tiles + width2_tiles) + triton.cdiv(num_heads, config.block_n)
    k_steps = triton.cdiv(in_features, config.block_k)
    split_k = config.split_k or max(1, min(k_steps, triton.cdiv(2 * device_num_sms(x.device), num_tiles)))
    k_steps_per_split = triton.cdiv(k_steps, split_k)
    split_k = triton.cdiv(k_steps, k_steps_per_split)  # no empty split
    num_outputs = 2 * (width + width2) + num_heads
    if split_k > 1:
        partials = torch.empty(split_k, num_tokens, num_outputs, dtype=torch.float32, device=x.device)
        counters = tile_counters(x.device, num_tiles)
    else:
        partials, counters = score, score  # never read
    kv2_weight, score2_weight, ape2 = second if second is not None else (kv_weight, score_weight, ape)
    _projections_kernel[(num_tiles, split_k)](
        x, kv_weight, score_weight, kv2_weight, score2_weight, head_weight if head_weight is not None else kv_weight,
        kv, score, kv2, score2, heads, ape.contiguous(), ape2.contiguous(), positions, partials, counters,
        num_tokens, in_features, width, width2, num_heads, float(head_scale), x.stride(0),
        num_tokens * num_outputs if split_k > 1 else 0, num_outputs,
        RATIO=ratio, WIDTH_TILES=width_tiles, WIDTH2_TILES=width2_tiles, SPLIT_K=split_k,
        K_STEPS_PER_SPLIT=k_steps_per_split, BLOCK_N=config.block_n,
        BLOCK_T=max(16, triton.next_power_of_2(num_tokens)), BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **dependent_launch(x.device),
        PREFETCH_L2=weight_rows_prefetchable(
            x.device, (kv_weight, score_weight, kv2_weight, score2_weight, head_weight),
            in_features * kv_weight.element_size(), k_steps_per_split * config.block_k * kv_weight.element_size()),
    )
    return (kv, score) + ((kv2, score2) if second is not None else ()) + ((heads,) if head_weight is not None else ())
