"""The grouped FP4 / FP8 expert matmul kernel (Triton) behind `fp4_experts.py`'s launches.

One program computes a [BN, BM] tile of out^T for one row tile of one expert: it finds its expert by a prefix sum
over every expert's tile count (no host sync), loops over K decoding each weight step as `FP4_DECODE` says
(`expert_configs.Fp4Decode`; `WEIGHT_FORMAT` 0 = FP4 e2m1, 1 = FP8 e4m3), optionally accumulates a second
weight into a second tile from the same x (gate and up), and runs the epilogue: SwiGLU with clamps, a per-row
routing weight, k-quartered output columns, zeros for unrouted rows; with `SPLIT_K` > 1 the last of the tile's
programs sums the partials first (`split_k.py`). Its torch reference and tests are those of `fp4_experts.py`.
Legend: R routed rows, BM rows per tile, BN output features per tile, BK input features per step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moemesh.common.kernels.dependent_launch import wait_for_inputs
from moemesh.common.kernels.dequant_tiles import fp4_packed_tile, fp4_tile, fp4_tile_halves, fp8_tile
from moemesh.common.kernels.expert_rows import find_tile, quartered_columns, store_unrouted_zeros
from moemesh.common.kernels.ptx_decode import (
    FOLDED_SCALE_SHIFT, fp4_scale_pairs, fp4_scale_pairs_from_words, fp4_tile_halves_bf16_asm,
    fp4_tile_halves_bf16_folded_asm, fp4_tile_quarters_bf16_asm, fp8_tile_quarters_bf16_asm,
)
from moemesh.common.kernels.split_k import take_ticket


@triton.jit
def _accumulate(acc, x, w_ptr, s_ptr, scales, offs_n, mask_n, k_begin, num_cols, stride_wn, stride_sn,
                WEIGHT_FORMAT: tl.constexpr, FP4_DECODE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BN, BM] += W[offs_n, k_begin:+BK] @ x^T for x [BM, BK]; the weight decode per FP4_DECODE.

    `scales` is this step's prefetched scale tile where the decode takes one (ASM_QUAD), else unused."""
    if WEIGHT_FORMAT == 1 and FP4_DECODE == 6:  # FP8 weights, inline-PTX e4m3 decode by k mod 4
        q0, q1, q2, q3 = fp8_tile_quarters_bf16_asm(w_ptr, s_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn,
                                                    stride_sn, BLOCK_K)  # [BN, BK/4] each
        x_b0, x_b1 = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 4, 2, 2]))
        x_0, x_2 = tl.split(x_b0)
        x_1, x_3 = tl.split(x_b1)
        acc = tl.dot(q0, tl.trans(x_0), acc)
        acc = tl.dot(q1, tl.trans(x_1), acc)
        acc = tl.dot(q2, tl.trans(x_2), acc)
        acc = tl.dot(q3, tl.trans(x_3), acc)
    elif WEIGHT_FORMAT == 1:
        w = fp8_tile(w_ptr, s_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, stride_sn, BLOCK_K)
        if FP4_DECODE == 3 and BLOCK_M == 1:  # FMA, one row: acc [BN, BK] summed after the loop
            acc += w * x.to(tl.float32)
        elif FP4_DECODE == 3:  # FMA also for FP8 weights (block_m may be below tl.dot's 16)
            acc += tl.sum(w[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
        else:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    elif FP4_DECODE == 0:  # JOIN
        w = fp4_tile(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_N, BLOCK_K)
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    elif FP4_DECODE == 2:  # DOT_SCALED
        packed, scales = fp4_packed_tile(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_K)
        acc = tl.dot_scaled(packed, scales, "e2m1", tl.trans(x), None, "bf16", acc)
    elif FP4_DECODE == 6 or FP4_DECODE == 7:  # ASM_QUAD(_WORD_SCALES): four bf16 quarters by k mod 4 (W * 2^-16)
        if FP4_DECODE == 7:
            scales = fp4_scale_pairs_from_words(s_ptr, offs_n, mask_n, k_begin, stride_sn, BLOCK_K)
        q0, q1, q2, q3 = fp4_tile_quarters_bf16_asm(w_ptr, scales, offs_n, mask_n, k_begin, stride_wn,
                                                    BLOCK_N, BLOCK_K)  # [BN, BK/4] each
        x_b0, x_b1 = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 4, 2, 2]))  # k % 2 == 0 / 1: [BM, BK/4, 2]
        x_0, x_2 = tl.split(x_b0)  # k % 4 == 0 / 2: [BM, BK/4]
        x_1, x_3 = tl.split(x_b1)  # k % 4 == 1 / 3
        acc = tl.dot(q0, tl.trans(x_0), acc)
        acc = tl.dot(q1, tl.trans(x_1), acc)
        acc = tl.dot(q2, tl.trans(x_2), acc)
        acc = tl.dot(q3, tl.trans(x_3), acc)
    elif FP4_DECODE == 4 or FP4_DECODE == 5:  # ASM / ASM_FOLDED: bf16 halves from inline PTX
        if FP4_DECODE == 4:
            w_even, w_odd = fp4_tile_halves_bf16_asm(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn,
                                                     BLOCK_N, BLOCK_K)  # [BN, BK/2] bf16 each
        else:  # W * 2^-16, rescaled by the caller after the K loop
            w_even, w_odd = fp4_tile_halves_bf16_folded_asm(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn,
                                                            stride_sn, BLOCK_N, BLOCK_K)
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))  # [BM, BK/2] each
        acc = tl.dot(w_even, tl.trans(x_even), acc)
        acc = tl.dot(w_odd, tl.trans(x_odd), acc)
    else:  # HALVES or FMA: even-k and odd-k columns apart
        w_even, w_odd = fp4_tile_halves(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn,
                                        BLOCK_N, BLOCK_K)  # [BN, BK/2] each
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))  # [BM, BK/2] each
        if FP4_DECODE == 1:
            acc = tl.dot(w_even.to(x.dtype), tl.trans(x_even), acc)
            acc = tl.dot(w_odd.to(x.dtype), tl.trans(x_odd), acc)
        elif BLOCK_M == 1:  # FMA, one row: acc [BN, BK/2] elementwise, summed over k after the loop
            acc += w_even * x_even.to(tl.float32) + w_odd * x_odd.to(tl.float32)
        else:  # FMA: [BN, 1, BK/2] * [1, BM, BK/2] summed over k
            products = w_even[:, None, :] * x_even.to(tl.float32)[None, :, :]
            products += w_odd[:, None, :] * x_odd.to(tl.float32)[None, :, :]
            acc += tl.sum(products, axis=2)
    return acc


@triton.jit
def _quarter_dots(acc, x_0, x_1, x_2, x_3, w_ptr, scales, offs_n, mask_n, k_begin, stride_wn,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BN, BM] += W[offs_n, k_begin:+BK] @ x^T with x given as its four k-mod-4 quarters [BM, BK/4]
    (ASM_QUAD's decode and its four dots, the same products in the same order)."""
    q0, q1, q2, q3 = fp4_tile_quarters_bf16_asm(w_ptr, scales, offs_n, mask_n, k_begin, stride_wn,
                                                BLOCK_N, BLOCK_K)  # [BN, BK/4] each
    acc = tl.dot(q0, tl.trans(x_0), acc)
    acc = tl.dot(q1, tl.trans(x_1), acc)
    acc = tl.dot(q2, tl.trans(x_2), acc)
    return tl.dot(q3, tl.trans(x_3), acc)


@triton.jit
def _grouped_kernel(
    x_ptr, wa_ptr, sa_ptr, wb_ptr, sb_ptr, out_ptr, offsets_ptr, row_weights_ptr, partial_ptr, counter_ptr,
    num_experts, out_features, swiglu_limit,
    stride_xr, stride_we, stride_wn, stride_se, stride_sn, stride_or, stride_ps,
    IN_FEATURES: tl.constexpr, WEIGHT_FORMAT: tl.constexpr, FP4_DECODE: tl.constexpr, FUSE_SWIGLU: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_ROW_WEIGHTS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    x_rows_ptr=None, out_rows_ptr=None, num_rows=None,
    X_QUARTERED: tl.constexpr = False, OUT_QUARTERED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    wait_for_inputs(USE_PDL)
    tile_id = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    expert, row_begin, row_end, expert_tiles = find_tile(offsets_ptr, tile_id, num_experts, BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        if out_rows_ptr is not None:  # the tiles after every expert's: zeros for the rows without an expert
            store_unrouted_zeros(out_ptr, out_rows_ptr, offsets_ptr, tile_id - expert_tiles, pid_n, pid_s,
                                 num_experts, num_rows, out_features, stride_or, BLOCK_M, BLOCK_N)
        return
    offs_m = row_begin + tl.arange(0, BLOCK_M)  # [BM]
    mask_m = offs_m < row_end
    x_rows = offs_m  # [BM] the row of x each tile row reads
    if x_rows_ptr is not None:
        x_rows = tl.load(x_rows_ptr + offs_m, mask=mask_m, other=0)
    out_rows = offs_m  # [BM] the output row each tile row writes
    if out_rows_ptr is not None:
        out_rows = tl.load(out_rows_ptr + offs_m, mask=mask_m, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < out_features
    expert64 = expert.to(tl.int64)
    wa_ptr += expert64 * stride_we
    sa_ptr += expert64 * stride_se
    wb_ptr += expert64 * stride_we
    sb_ptr += expert64 * stride_se
    offs_k = tl.arange(0, BLOCK_K)
    offs_quarter = tl.arange(0, BLOCK_K // 4)
    K_STEPS: tl.constexpr = IN_FEATURES // BLOCK_K // SPLIT_K

    # FMA with one row per tile keeps per-column partial sums ("wide", no reduction per K step).
    WIDE: tl.constexpr = FP4_DECODE == 3 and BLOCK_M == 1
    ACC_COLS: tl.constexpr = (BLOCK_K // 2 if WEIGHT_FORMAT == 0 else BLOCK_K) if WIDE else BLOCK_M
    acc_a = tl.zeros([BLOCK_N, ACC_COLS], dtype=tl.float32)  # (x W_a^T)^T tile
    acc_b = tl.zeros([BLOCK_N, ACC_COLS], dtype=tl.float32)  # (x W_b^T)^T tile, SwiGLU only
    # ASM_QUAD: the scale bytes of step i + 1 are loaded during step i (register double buffer).
    PREFETCH: tl.constexpr = WEIGHT_FORMAT == 0 and FP4_DECODE == 6
    k_first = pid_s * K_STEPS * BLOCK_K
    scales_a = fp4_scale_pairs(sa_ptr, offs_n, mask_n & PREFETCH, k_first, stride_sn, BLOCK_K)  # [BN, G]
    scales_b = fp4_scale_pairs(sb_ptr, offs_n, mask_n & (PREFETCH and FUSE_SWIGLU), k_first, stride_sn, BLOCK_K)
    for step in range(0, K_STEPS):
        k_begin = k_first + step * BLOCK_K
        ahead = mask_n & (PREFETCH and step + 1 < K_STEPS)
        next_a = fp4_scale_pairs(sa_ptr, offs_n, ahead, k_begin + BLOCK_K, stride_sn, BLOCK_K)
        if X_QUARTERED:  # x's quarters are contiguous: loaded straight into the dots' shared-memory operand
            x_row = x_ptr + x_rows[:, None] * stride_xr + k_begin + offs_quarter[None, :]  # [BM, BK/4]
            x_0 = tl.load(x_row, mask=mask_m[:, None], other=0.0)
            x_1 = tl.load(x_row + BLOCK_K // 4, mask=mask_m[:, None], other=0.0)
            x_2 = tl.load(x_row + BLOCK_K // 2, mask=mask_m[:, None], other=0.0)
            x_3 = tl.load(x_row + 3 * (BLOCK_K // 4), mask=mask_m[:, None], other=0.0)
            acc_a = _quarter_dots(acc_a, x_0, x_1, x_2, x_3, wa_ptr, scales_a, offs_n, mask_n, k_begin, stride_wn,
                                  BLOCK_N, BLOCK_K)
        else:
            x = tl.load(x_ptr + x_rows[:, None] * stride_xr + (k_begin + offs_k)[None, :], mask=mask_m[:, None],
                        other=0.0)
            acc_a = _accumulate(acc_a, x, wa_ptr, sa_ptr, scales_a, offs_n, mask_n, k_begin, IN_FEATURES, stride_wn,
                                stride_sn, WEIGHT_FORMAT, FP4_DECODE, BLOCK_M, BLOCK_N, BLOCK_K)
        scales_a = next_a
        if FUSE_SWIGLU:
            next_b = fp4_scale_pairs(sb_ptr, offs_n, ahead, k_begin + BLOCK_K, stride_sn, BLOCK_K)
            if X_QUARTERED:
                acc_b = _quarter_dots(acc_b, x_0, x_1, x_2, x_3, wb_ptr, scales_b, offs_n, mask_n, k_begin,
                                      stride_wn, BLOCK_N, BLOCK_K)
            else:
                acc_b = _accumulate(acc_b, x, wb_ptr, sb_ptr, scales_b, offs_n, mask_n, k_begin, IN_FEATURES,
                                    stride_wn, stride_sn, WEIGHT_FORMAT, FP4_DECODE, BLOCK_M, BLOCK_N, BLOCK_K)
            scales_b = next_b

    if WIDE:
        acc_a = tl.sum(acc_a, axis=1)[:, None]  # [BN, 1]
        acc_b = tl.sum(acc_b, axis=1)[:, None]
    if WEIGHT_FORMAT == 0 and FP4_DECODE >= 5:  # ASM_FOLDED / ASM_QUAD*: accumulated W * 2^-16 (exact rescale)
        acc_a = acc_a * FOLDED_SCALE_SHIFT
        acc_b = acc_b * FOLDED_SCALE_SHIFT
    store_mask = mask_n[:, None] & mask_m[None, :]  # [BN, BM]
    if SPLIT_K > 1:
        # Partials [S, R, (a|b), N_out] fp32, indexed by real rows (tiles' padding rows skipped).
        NUM_PARTS: tl.constexpr = 2 if FUSE_SWIGLU else 1
        part_cols = offs_m[None, :].to(tl.int64) * (NUM_PARTS * out_features) + offs_n[:, None]  # [BN, BM]
        tl.store(partial_ptr + pid_s * stride_ps + part_cols, acc_a, mask=store_mask)
        if FUSE_SWIGLU:
            tl.store(partial_ptr + pid_s * stride_ps + part_cols + out_features, acc_b, mask=store_mask)
        is_last = take_ticket(counter_ptr + tile_id * tl.num_programs(1) + pid_n, SPLIT_K)
        store_mask = store_mask & is_last
        acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on arrival order
            acc_a += tl.load(partial_ptr + s * stride_ps + part_cols, mask=store_mask, other=0.0,
                             cache_modifier=".cg")
            if FUSE_SWIGLU:
                acc_b += tl.load(partial_ptr + s * stride_ps + part_cols + out_features, mask=store_mask,
                                 other=0.0, cache_modifier=".cg")

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
    out_cols = quartered_columns(offs_n) if OUT_QUARTERED else offs_n  # [BN]
    out_ptrs = out_ptr + out_rows[None, :].to(tl.int64) * stride_or + out_cols[:, None]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=store_mask)
