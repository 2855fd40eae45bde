"""Fused mHC kernels (docs/model.md §2.2): `hc_pre`, `hc_post`, `hc_head` in two or one launches.

Legend: T tokens, N streams (hc_mult), NP N padded to a power of two, D hidden, K = N·D flattened
stream width, M mix rows ((2 + N)·N for hc_pre, N for hc_head), BM M padded, S split-K parts.

The torch functions in `common/model/hyper.py` are the reference; these compute the same function:
- launch 1 (grid [T/BT, S]): per token and K slice, the partial mix Σ_k h[t, k]·fn[m, k] and the
  partial Σ_k h[t, k]² (fp32, one read of h and of fn). The RMS normalisation is a per-token scalar,
  so it is applied after the GEMV: mix = rsqrt(mean h² + eps)·(h·fnᵀ). Decode (T ≤ 16) uses
  `_mix_gemv_kernel` (one token per program, fp32 multiply-adds); larger T `_mix_partials_kernel`
  (`tl.dot`: fp32 FMA, tf32x3, or bf16x3 = fn split in three bf16 pieces so every tensor-core
  product is exact when h is bf16).
- launch 2 (`_hc_finish_kernel`, grid [T, D/BD]): sums the S partials, applies sigmoid / softmax and
  the full Sinkhorn on the NP×NP matrix in registers, and writes x[t, d] = Σ_n pre_n·h[t, n, d] for its
  D slice. Every D slice recomputes the (tiny) Sinkhorn instead of waiting for another program; only
  slice 0 stores post and comb. hc_head runs the same two launches with HEAD=True (no post/comb).
- `_hc_post_kernel` (grid [T, D/BD]): h'[t, k, d] = post_k·y[t, d] + Σ_j comb[j, k]·h[t, j, d], with the
  reference's three roundings to h's dtype reproduced (post·y, the matmul, the sum), so bf16 results
  match torch bit for bit up to fp32 summation order; y may come as two addends (the MoE's routed and
  shared outputs), summed and rounded to the dtype first as torch's `routed + shared` does, and the routed
  part as the experts' per-slot outputs [T, K, D], added in slot order first by the slot sum's own code
  (`route_layout.sum_slot_row`, bit for bit `sum_slots_in_order`): no slot-sum launch. At decode sizes
  it can also do launch 1 of the hc_pre that reads its output next (`next_fn`): each D slice's partial
  mix and Σ h² of the values it just rounded and stored, one split per slice, so that hc_pre is one launch.
No launch reads a value on the host or sizes a buffer from data: all of it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.route_layout import sum_slot_row

DEFAULT_NUM_SMS = 132  # H200/H100 SXM; used when no CUDA device answers (the interpreter)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


@dataclass(frozen=True)
class MixConfig:
    """Launch shape of the mix GEMV (launch 1) and of the finish (launch 2).

    block_t 1 selects the GEMV kernel (one token per program, fp32 multiply-adds, no tl.dot).

    precision of the fp32 GEMV: "ieee" keeps fp32 products (the reference's F.linear in fp32 with TF32
    off) on the FMA units; "tf32x3" uses tensor cores at near-fp32 accuracy; "bf16x3" (h in bf16 only)
    splits fn into three bf16 pieces, so each tensor-core product is exact and only the fp32
    accumulation order differs from "ieee".
    """

    block_t: int
    block_k: int
    num_splits: int
    block_d: int
    precision: str = "ieee"
    num_warps: int = 4
    finish_num_warps: int = 4
    approx_division: bool = False  # Sinkhorn divisions as div.full.f32 (~2 ulp) instead of IEEE division

    def __post_init__(self) -> None:
        if self.block_k < 16 or not (self.block_t == 1 or self.block_t >= 16):
            raise ValueError("block_k must be >= 16 and block_t 1 (GEMV kernel) or >= 16 (tl.dot)")
        if self.block_t == 1 and self.precision != "ieee":
            raise ValueError("the GEMV kernel (block_t 1) computes fp32 products: precision must be ieee")
        if self.num_splits < 1:
            raise ValueError("num_splits must be >= 1")
        if self.precision not in ("ieee", "tf32x3", "bf16x3"):
            raise ValueError(f"unknown precision {self.precision!r}")


def choose_mix_config(num_tokens: int, num_cols: int, device: torch.device,
                      dtype: torch.dtype | None = None) -> MixConfig:
    """Launch 1 covers the SMs about twice; launch 2 keeps its Sinkhorn inside one warp at decode.

    - T <= 16: the GEMV kernel (one token per program, no tl.dot): measurements showed the FMA `tl.dot`
      at 16×128×32 tiles as the slow part of a 19 µs hc_pre at T = 1.
    - T > 16 with h in bf16: "bf16x3" tensor-core dots (measured at T = 2048: 92 µs against 370 µs for the
      fp32 FMA dot); other dtypes keep the FMA dot with tiles ptxas fits without spilling.
    - launch 2 at decode: one warp, so the 40 small reductions of the Sinkhorn are shuffles, not
      shared-memory round trips with barriers between 4 warps.
    """
    bf16 = dtype == torch.bfloat16
    num_sms = _num_sms(device)
    if num_tokens <= 16:
        block_t, block_k, num_warps, precision = 1, 128, 4, "ieee"
    elif num_tokens <= 64:
        block_t, block_k, num_warps, precision = (16, 128, 4, "bf16x3") if bf16 else (32, 128, 4, "ieee")
    else:
        block_t, block_k, num_warps, precision = (128, 64, 8, "bf16x3") if bf16 else (64, 64, 8, "ieee")
    num_t_blocks = triton.cdiv(num_tokens, block_t)
    min_k_steps = 1 if block_t == 1 else 2  # run 2: 128 one-step splits beat 64 two-step ones at T = 1
    max_splits = max(1, min(128, num_cols // (min_k_steps * block_k)))
    wanted = max(1, (2 if num_tokens <= 64 else 1) * num_sms // num_t_blocks)  # run 2, T = 2048: 8 beat 16
    num_splits = 1 << (min(wanted, max_splits).bit_length() - 1)  # a power of two, not above either bound
    if num_tokens <= 64:  # run 2: one warp and 512-wide D slices fastest at T = 1 and 64
        block_d, finish_num_warps = 512, 1
    else:  # run 2, T = 2048: 2 warps over 1024-wide slices (86 µs) beat 4 warps (97 µs)
        block_d, finish_num_warps = 1024, 2
    return MixConfig(block_t=block_t, block_k=block_k, num_splits=num_splits, block_d=block_d,
                     precision=precision, num_warps=num_warps, finish_num_warps=finish_num_warps)


@triton.jit
def _mix_gemv_kernel(h_ptr, fn_ptr, mix_part_ptr, sq_part_ptr, num_tokens, num_cols, num_mix,
                     K_STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # one token per program: h [T, K], fn [M, K] fp32 -> mix_part [S, T, BM], sq_part [S, T] fp32
    token = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_mix
    products = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)  # reduced over K once, after the loop
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    col_start = pid_s * (K_STEPS * BLOCK_K)
    for step in range(0, K_STEPS):
        cols = col_start + step * BLOCK_K + tl.arange(0, BLOCK_K)
        col_mask = cols < num_cols
        x = tl.load(h_ptr + token.to(tl.int64) * num_cols + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BK]
        w = tl.load(fn_ptr + rows[:, None] * num_cols + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)  # [BM, BK]
        products += w * x[None, :]
        squares += x * x
    part_row = pid_s * num_tokens + token
    tl.store(mix_part_ptr + part_row.to(tl.int64) * BLOCK_M + rows, tl.sum(products, axis=1))
    tl.store(sq_part_ptr + part_row, tl.sum(squares, axis=0))


@triton.jit
def _mix_partials_kernel(h_ptr, fn_ptr, mix_part_ptr, sq_part_ptr, num_tokens, num_cols, num_mix,
                         K_STEPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    # h [T, K] (any float dtype), fn [M, K] fp32 -> mix_part [S, T, BM], sq_part [S, T] fp32
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_mix
    acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    col_start = pid_s * (K_STEPS * BLOCK_K)
    for step in range(0, K_STEPS):
        cols = col_start + step * BLOCK_K + tl.arange(0, BLOCK_K)
        col_mask = cols < num_cols
        x = tl.load(h_ptr + tokens[:, None].to(tl.int64) * num_cols + cols[None, :],
                    mask=token_mask[:, None] & col_mask[None, :], other=0.0)  # [BT, BK]
        w = tl.load(fn_ptr + rows[:, None] * num_cols + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)  # [BM, BK] fp32
        x32 = x.to(tl.float32)
        sq += tl.sum(x32 * x32, axis=1)
        if PRECISION == "bf16x3":  # h is bf16: w = w1 + w2 + w3 in bf16 pieces, three exact-product dots
            w1 = w.to(tl.bfloat16)
            rest = w - w1.to(tl.float32)
            w2 = rest.to(tl.bfloat16)
            w3 = (rest - w2.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(x, tl.trans(w1), acc)
            acc = tl.dot(x, tl.trans(w2), acc)
            acc = tl.dot(x, tl.trans(w3), acc)
        else:
            acc = tl.dot(x32, tl.trans(w), acc, input_precision=PRECISION)
    part_rows = pid_s * num_tokens + tokens
    tl.store(mix_part_ptr + part_rows[:, None].to(tl.int64) * BLOCK_M + rows[None, :], acc,
             mask=token_mask[:, None])
    tl.store(sq_part_ptr + part_rows, sq, mask=token_mask)


@triton.jit
def _sum_parts_1d(part_row_ptr, offsets, offset_mask, split_offsets, split_mask):
    """Σ over splits of part[s, offsets] for offsets [X]; split_offsets [BS] already scaled by the split stride."""
    ptrs = part_row_ptr + split_offsets[:, None] + offsets[None, :]
    return tl.sum(tl.load(ptrs, mask=split_mask[:, None] & offset_mask[None, :], other=0.0), axis=0)


@triton.jit
def _sum_parts_2d(part_row_ptr, offsets, offset_mask, split_offsets, split_mask):
    """As `_sum_parts_1d` for offsets [X, Y]."""
    ptrs = part_row_ptr + split_offsets[:, None, None] + offsets[None, :, :]
    return tl.sum(tl.load(ptrs, mask=split_mask[:, None, None] & offset_mask[None, :, :], other=0.0), axis=0)


@triton.jit
def _divide(numerator, denominator, APPROX: tl.constexpr):
    """IEEE division (the reference's rounding) or the ~2-ulp approximate one (shorter dependency chain)."""
    if APPROX:
        return tl.fdiv(numerator, denominator, ieee_rounding=False)
    else:
        return numerator / denominator


@triton.jit
def _hc_finish_kernel(h_ptr, mix_part_ptr, sq_part_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr,
                      out_weight_ptr, num_tokens, hidden, num_splits, hc_eps, norm_eps, out_eps,
                      SINKHORN_ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD: tl.constexpr, OUT_NORM: tl.constexpr,
                      APPROX_DIV: tl.constexpr):
    # h [T, N, D]; parts from launch 1 -> x [T, D] (h dtype), post [T, N], comb [T, N, N] fp32
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    num_cols = N * hidden
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    sq = tl.sum(tl.load(sq_part_ptr + splits * num_tokens + pid_t, mask=split_mask, other=0.0), axis=0)
    inv_rms = 1.0 / tl.sqrt(sq / num_cols + norm_eps)
    part_row = mix_part_ptr + pid_t.to(tl.int64) * BLOCK_M
    split_offsets = splits.to(tl.int64) * num_tokens * BLOCK_M
    streams = tl.arange(0, NP)
    stream_mask = streams < N
    # the streams' slice is loaded first: its latency overlaps the partial sums and the Sinkhorn
    dims = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_mask = dims < hidden
    tile = tl.load(h_ptr + pid_t.to(tl.int64) * num_cols + streams[:, None] * hidden + dims[None, :],
                   mask=stream_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)  # [NP, BD]
    pre_mix = _sum_parts_1d(part_row, streams, stream_mask, split_offsets, split_mask) * inv_rms  # [NP]
    pre = tl.sigmoid(pre_mix * tl.load(scale_ptr) + tl.load(base_ptr + streams, mask=stream_mask, other=0.0))
    pre = tl.where(stream_mask, pre + hc_eps, 0.0)
    if not HEAD:
        write_mask = stream_mask & (pid_d == 0)
        post_mix = _sum_parts_1d(part_row, N + streams, stream_mask, split_offsets, split_mask) * inv_rms
        post_logit = post_mix * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + streams, mask=stream_mask, other=0.0)
        tl.store(post_ptr + pid_t * N + streams, 2.0 * tl.sigmoid(post_logit), mask=write_mask)
        # comb [NP(j in), NP(k out)]: softmax over k, then Sinkhorn (columns first, then rows/columns)
        pair = streams[:, None] * N + streams[None, :]
        pair_mask = stream_mask[:, None] & stream_mask[None, :]
        comb_mix = _sum_parts_2d(part_row, 2 * N + pair, pair_mask, split_offsets, split_mask) * inv_rms
        logits = comb_mix * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + pair, mask=pair_mask, other=0.0)
        logits = tl.where(pair_mask, logits, float("-inf"))
        row_max = tl.where(stream_mask, tl.max(logits, axis=1), 0.0)
        expd = tl.exp(logits - row_max[:, None])
        row_sum = tl.where(stream_mask, tl.sum(expd, axis=1), 1.0)
        comb = tl.where(pair_mask, expd / row_sum[:, None] + hc_eps, 0.0)
        comb = _divide(comb, tl.sum(comb, axis=0)[None, :] + hc_eps, APPROX_DIV)
        for _ in range(SINKHORN_ITERS - 1):
            comb = _divide(comb, tl.sum(comb, axis=1)[:, None] + hc_eps, APPROX_DIV)
            comb = _divide(comb, tl.sum(comb, axis=0)[None, :] + hc_eps, APPROX_DIV)
        tl.store(comb_ptr + pid_t * N * N + pair, comb, mask=pair_mask & (pid_d == 0))
    x = tl.sum(pre[:, None] * tile, axis=0)
    if OUT_NORM:  # RMSNorm(x) of the rounded x, as the block's attn_norm / ffn_norm; BLOCK_D covers D
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
        out_scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + out_eps)
        x = tl.load(out_weight_ptr + dims, mask=dim_mask, other=0.0) * (x * out_scale)
    tl.store(x_ptr + pid_t.to(tl.int64) * hidden + dims, x.to(x_ptr.dtype.element_ty), mask=dim_mask)


@triton.jit
def _hc_post_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, hidden,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr, addend_ptr=None,
                    next_fn_ptr=None, mix_part_ptr=None, sq_part_ptr=None, num_mix=0, BLOCK_M: tl.constexpr = 1,
                    Y_SLOTS: tl.constexpr = 0):
    # y [T, D], or with Y_SLOTS = K the routed slots [T, K, D] summed in slot order (`sum_slot_row`),
    # (+ addend [T, D], rounded to the dtype), h [T, N, D] (same dtype), post [T, N], comb [T, N, N] fp32
    # -> out [T, N, D]; with next_fn [M, N·D] fp32 also the next hc_pre's launch-1 partials of out over
    # this program's D slice: mix_part [D/BD, T, BM], sq_part [D/BD, T]
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    dims = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_mask = dims < hidden
    streams = tl.arange(0, NP)
    stream_mask = streams < N
    post = tl.load(post_ptr + pid_t * N + streams, mask=stream_mask, other=0.0).to(dtype).to(tl.float32)
    if Y_SLOTS:  # the routed slots' in-order sum, bit for bit what `_sum_slots_kernel` stores
        slot_row = y_ptr + pid_t.to(tl.int64) * Y_SLOTS * hidden + dims  # [BD] slot 0 of this token
        y = sum_slot_row(slot_row, hidden, dim_mask, Y_SLOTS, dtype == tl.bfloat16).to(tl.float32)
    else:
        y = tl.load(y_ptr + pid_t.to(tl.int64) * hidden + dims, mask=dim_mask, other=0.0).to(tl.float32)
    if addend_ptr is not None:  # y + addend in the dtype, as torch adds two tensors of it
        addend = tl.load(addend_ptr + pid_t.to(tl.int64) * hidden + dims, mask=dim_mask, other=0.0).to(tl.float32)
        y = (y + addend).to(dtype).to(tl.float32)
    scaled = (post[:, None] * y[None, :]).to(dtype).to(tl.float32)  # [NP, BD], rounded as torch's post·y
    mixed = tl.zeros([NP, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(N):
        comb_row = tl.load(comb_ptr + pid_t * N * N + j * N + streams, mask=stream_mask, other=0.0)
        comb_row = comb_row.to(dtype).to(tl.float32)  # comb[j, :] as torch casts it
        h_row = tl.load(h_ptr + (pid_t.to(tl.int64) * N + j) * hidden + dims, mask=dim_mask, other=0.0)
        mixed += comb_row[:, None] * h_row.to(tl.float32)[None, :]
    out = scaled + mixed.to(dtype).to(tl.float32)
    out_rows = pid_t.to(tl.int64) * N + streams
    tl.store(out_ptr + out_rows[:, None] * hidden + dims[None, :], out.to(dtype),
             mask=stream_mask[:, None] & dim_mask[None, :])
    if next_fn_ptr is not None:  # launch 1 of the next hc_pre over the rounded values just stored
        rounded = tl.where(dim_mask[None, :], out.to(dtype).to(tl.float32), 0.0)  # [NP, BD]
        _store_mix_partials(rounded, streams, dims, dim_mask, next_fn_ptr, mix_part_ptr, sq_part_ptr, num_mix, hidden,
                            pid_t, pid_d, N, BLOCK_M, BLOCK_D)


@triton.jit
def _store_mix_partials(rounded, streams, dims, dim_mask, next_fn_ptr, mix_part_ptr, sq_part_ptr, num_mix, hidden,
                        pid_t, pid_d, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Launch 1 of an hc_pre over one D slice of token pid_t's streams rounded [NP, BD] (fp32 of the stored values,
    zeros past D): its row of mix_part [D/BD, T, BM] (Σ h·fnᵀ over the slice) and of sq_part [D/BD, T] (Σ h²)."""
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_mix
    products = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    squares = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(N):
        stream_k = tl.sum(tl.where(streams[:, None] == k, rounded, 0.0), axis=0)  # [BD], row k exactly
        w = tl.load(next_fn_ptr + rows[:, None] * (N * hidden) + k * hidden + dims[None, :],
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BM, BD]
        products += w * stream_k[None, :]
        squares += stream_k * stream_k
    part_row = pid_d * tl.num_programs(0) + pid_t
    tl.store(mix_part_ptr + part_row.to(tl.int64) * BLOCK_M + rows, tl.sum(products, axis=1))
    tl.store(sq_part_ptr + part_row, tl.sum(squares, axis=0))


@triton.jit
def _embed_streams_kernel(ids_ptr, table_ptr, out_ptr, hidden, N: tl.constexpr, NP: tl.constexpr,
                          BLOCK_D: tl.constexpr, next_fn_ptr=None, mix_part_ptr=None, sq_part_ptr=None, num_mix=0,
                          BLOCK_M: tl.constexpr = 1):
    # ids [T] int, table [V, D] -> out [T, N, D] (N copies of the token's row, in out's dtype); with next_fn [M, N·D]
    # fp32 also the first hc_pre's launch-1 partials over this program's D slice, as `_hc_post_kernel` does them
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    dims = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_mask = dims < hidden
    streams = tl.arange(0, NP)
    stream_mask = streams < N
    token = tl.load(ids_ptr + pid_t).to(tl.int64)
    row = tl.load(table_ptr + token * hidden + dims, mask=dim_mask, other=0.0).to(dtype)  # [BD]
    out = tl.zeros([NP, BLOCK_D], dtype=dtype) + row[None, :]  # [NP, BD]
    out_rows = pid_t.to(tl.int64) * N + streams
    tl.store(out_ptr + out_rows[:, None] * hidden + dims[None, :], out, mask=stream_mask[:, None] & dim_mask[None, :])
    if next_fn_ptr is not None:
        rounded = tl.where(dim_mask[None, :], out.to(tl.float32), 0.0)  # [NP, BD]
        _store_mix_partials(rounded, streams, dims, dim_mask, next_fn_ptr, mix_part_ptr, sq_part_ptr, num_mix, hidden,
                            pid_t, pid_d, N, BLOCK_M, BLOCK_D)


def _launch_mix(h: torch.Tensor, fn: torch.Tensor, config: MixConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Launch 1 -> (mix_part [S, T, BM], sq_part [S, T], BM)."""
    num_tokens, num_streams, hidden = h.shape
    num_cols = num_streams * hidden
    num_mix = fn.shape[0]
    if config.precision == "bf16x3" and h.dtype != torch.bfloat16:
        raise ValueError("precision bf16x3 needs h in bf16")
    gemv = config.block_t == 1
    block_m = triton.next_power_of_2(num_mix) if gemv else max(16, triton.next_power_of_2(num_mix))
    k_steps = triton.cdiv(triton.cdiv(num_cols, config.num_splits), config.block_k)  # per split
    mix_part = torch.empty(config.num_splits, num_tokens, block_m, dtype=torch.float32, device=h.device)
    sq_part = torch.empty(config.num_splits, num_tokens, dtype=torch.float32, device=h.device)
    grid = (triton.cdiv(num_tokens, config.block_t), config.num_splits)
    if gemv:
        _mix_gemv_kernel[grid](h, fn, mix_part, sq_part, num_tokens, num_cols, num_mix, K_STEPS=k_steps,
                               BLOCK_M=block_m, BLOCK_K=config.block_k, num_warps=config.num_warps)
    else:
        _mix_partials_kernel[grid](h, fn, mix_part, sq_part, num_tokens, num_cols, num_mix, K_STEPS=k_steps,
                                   BLOCK_T=config.block_t, BLOCK_M=block_m, BLOCK_K=config.block_k,
                                   PRECISION=config.precision, num_warps=config.num_warps)
    return mix_part, sq_part, block_m


def _finish(h, mix_part, sq_part, block_m, base, scale, x, post, comb, num_sinkhorn_iters, hc_eps, norm_eps,
            config: MixConfig, head: bool, out_norm: tuple[torch.Tensor, float] | None) -> None:
    num_tokens, num_streams, hidden = h.shape
    block_d, num_warps = config.block_d, config.finish_num_warps
    if out_norm is not None:  # the norm needs the whole row in one program
        block_d = triton.next_power_of_2(hidden)
        num_warps = max(num_warps, min(8, block_d // 512))
    out_weight, out_eps = out_norm if out_norm is not None else (x, 0.0)
    grid = (num_tokens, triton.cdiv(hidden, block_d))
    _hc_finish_kernel[grid](h, mix_part, sq_part, base, scale, x, post, comb, out_weight,
                            num_tokens, hidden, config.num_splits, float(hc_eps), float(norm_eps), float(out_eps),
                            SINKHORN_ITERS=num_sinkhorn_iters, N=num_streams, NP=triton.next_power_of_2(num_streams),
                            BLOCK_M=block_m, BLOCK_S=triton.next_power_of_2(config.num_splits),
                            BLOCK_D=block_d, HEAD=head, OUT_NORM=out_norm is not None,
                            APPROX_DIV=config.approx_division, num_warps=num_warps)


def _out_norm(out_norm: tuple[torch.Tensor, float] | None) -> tuple[torch.Tensor, float] | None:
    return None if out_norm is None else (out_norm[0].float().contiguous(), float(out_norm[1]))


def _outputs(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (x [T, D] h.dtype, post [T, N] fp32, comb [T, N, N] fp32)."""
    num_tokens, num_streams, hidden = h.shape
    return (torch.empty(num_tokens, hidden, dtype=h.dtype, device=h.device),
            torch.empty(num_tokens, num_streams, dtype=torch.float32, device=h.device),
            torch.empty(num_tokens, num_streams, num_streams, dtype=torch.float32, device=h.device))


def _prepare(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
    return h.contiguous(), fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()


def hc_pre(
    h: torch.Tensor,  # [T, N, D]
    fn: torch.Tensor,  # [M, N·D]
    base: torch.Tensor,  # [M]
    scale: torch.Tensor,  # [3]
    num_sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    config: MixConfig | None = None,
    out_norm: tuple[torch.Tensor, float] | None = None,
    partials: MixPartials | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `common.model.hyper.hc_pre`: (x [T, D] h.dtype, post [T, N] fp32, comb [T, N, N] fp32).

    out_norm (weight [D] fp32, eps): x comes back as RMSNorm(x) (as in `hyper.hc_pre`), same launches.
    partials: launch 1 already done by the hc_post that wrote h (`hc_post(..., next_fn=fn)`); only the finish
    runs. Used only when they were computed from this h and this fn.
    """
    if num_sinkhorn_iters < 1:
        raise ValueError("num_sinkhorn_iters must be >= 1")
    if partials is not None and partials.serves(h, fn):
        config = config or choose_mix_config(h.shape[0], h.shape[1] * h.shape[2], h.device, h.dtype)
        config = replace(config, num_splits=partials.mix_part.shape[0])
        _, _, base, scale = _prepare(h, partials.fn, base, scale)
        x, post, comb = _outputs(h)
        _finish(h, partials.mix_part, partials.sq_part, partials.block_m, base, scale, x, post, comb,
                num_sinkhorn_iters, hc_eps, norm_eps, config, head=False, out_norm=_out_norm(out_norm))
        return x, post, comb
    h, fn, base, scale = _prepare(h, fn, base, scale)
    num_tokens, num_streams, hidden = h.shape
    x, post, comb = _outputs(h)
    if num_tokens == 0:
        return x, post, comb
    config = config or choose_mix_config(num_tokens, num_streams * hidden, h.device, h.dtype)
    mix_part, sq_part, block_m = _launch_mix(h, fn, config)
    _finish(h, mix_part, sq_part, block_m, base, scale, x, post, comb, num_sinkhorn_iters, hc_eps, norm_eps,
            config, head=False, out_norm=_out_norm(out_norm))
    return x, post, comb


def hc_head(
    h: torch.Tensor,  # [T, N, D]
    fn: torch.Tensor,  # [N, N·D]
    base: torch.Tensor,  # [N]
    scale: torch.Tensor,  # [1]
    hc_eps: float,
    norm_eps: float,
    config: MixConfig | None = None,
    out_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Same contract as `common.model.hyper.hc_head` -> [T, D] in h's dtype (RMSNorm'ed with out_norm)."""
    h, fn, base, scale = _prepare(h, fn, base, scale)
    num_tokens, num_streams, hidden = h.shape
    x = torch.empty(num_tokens, hidden, dtype=h.dtype, device=h.device)
    if num_tokens == 0:
        return x
    config = config or choose_mix_config(num_tokens, num_streams * hidden, h.device, h.dtype)
    mix_part, sq_part, block_m = _launch_mix(h, fn, config)
    _finish(h, mix_part, sq_part, block_m, base, scale, x, x, x, 1, hc_eps, norm_eps, config, head=True,
            out_norm=_out_norm(out_norm))
    return x


@dataclass(frozen=True)
class MixPartials:
    """Launch 1 of an hc_pre, done ahead by the hc_post that wrote its h: per split the partial mix
    Σ h·fnᵀ and Σ h² of each token, for the fn named here (hc_pre uses them only for that fn and that h)."""

    h: torch.Tensor  # [T, N, D], the streams they were computed from
    fn: torch.Tensor  # [M, N·D] fp32
    mix_part: torch.Tensor  # [S, T, BM] fp32
    sq_part: torch.Tensor  # [S, T] fp32
    block_m: int

    def serves(self, h: torch.Tensor, fn: torch.Tensor) -> bool:
        return h is self.h and fn.data_ptr() == self.fn.data_ptr() and fn.shape == self.fn.shape


# above, the next hc_pre's mix in hc_post's (or the embedding's) launch costs more than its own launch: each D-slice
# program re-reads its [M, N·BD] slice of fn per token (measured at 64 tokens on an H200)
MAX_FUSED_MIX_TOKENS = 16


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            block_d: int | None = None, y_addend: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `common.model.hyper.hc_post`: y [T, D] or routed slots [T, K, D] (+ y_addend [T, D]),
    h [T, N, D] -> [T, N, D] in h's dtype."""
    return hc_post_with_mix(y, h, post, comb, None, block_d=block_d, y_addend=y_addend)[0]


def embed_streams(token_ids: torch.Tensor, table: torch.Tensor, num_streams: int, dtype: torch.dtype,
                  next_fn: torch.Tensor | None = None, block_d: int | None = None
                  ) -> tuple[torch.Tensor, MixPartials | None]:
    """token_ids [T], table [V, D] -> (streams [T, N, D] in dtype: N copies of each token's row, partials): with
    next_fn [M, N·D] fp32 (the first hc_pre) at T <= MAX_FUSED_MIX_TOKENS the same launch computes its launch 1
    as `hc_post_with_mix` does for the later ones; else None. One launch."""
    num_tokens, hidden = token_ids.shape[0], table.shape[1]
    out = torch.empty(num_tokens, num_streams, hidden, dtype=dtype, device=table.device)
    if num_tokens == 0:
        return out, None
    block_d = block_d or (256 if num_tokens <= 64 else 1024)
    num_d_blocks = triton.cdiv(hidden, block_d)
    partials, mix_args = None, {}
    if next_fn is not None and num_tokens <= MAX_FUSED_MIX_TOKENS:
        if next_fn.dtype != torch.float32 or not next_fn.is_contiguous() or next_fn.shape[1] != num_streams * hidden:
            raise ValueError(f"next_fn {tuple(next_fn.shape)} {next_fn.dtype} is not a contiguous fp32 "
                             f"[M, {num_streams * hidden}]")
        block_m = triton.next_power_of_2(next_fn.shape[0])
        mix_part = torch.empty(num_d_blocks, num_tokens, block_m, dtype=torch.float32, device=table.device)
        sq_part = torch.empty(num_d_blocks, num_tokens, dtype=torch.float32, device=table.device)
        partials = MixPartials(out, next_fn, mix_part, sq_part, block_m)
        mix_args = {"next_fn_ptr": next_fn, "mix_part_ptr": mix_part, "sq_part_ptr": sq_part,
                    "num_mix": next_fn.shape[0], "BLOCK_M": block_m}
    _embed_streams_kernel[(num_tokens, num_d_blocks)](token_ids.contiguous(), table.contiguous(), out, hidden,
                                                       N=num_streams, NP=triton.next_power_of_2(num_streams),
                                                       BLOCK_D=block_d, num_warps=4, **mix_args)
    return out, partials


def hc_post_with_mix(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     next_fn: torch.Tensor | None, block_d: int | None = None, y_addend: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, MixPartials | None]:
    """`hc_post` -> ([T, N, D], partials). y [T, D], or the routed experts' per-slot outputs [T, K, D], summed
    in slot order in the same launch (bit for bit `moe_layout.sum_slots_in_order`). next_fn [M, N·D] fp32 (the
    hc_pre that reads the result next): at T <= MAX_FUSED_MIX_TOKENS the same launch also computes that
    hc_pre's launch 1 (`MixPartials`); else None."""
    if y.dtype != h.dtype or (y_addend is not None and y_addend.dtype != y.dtype):
        raise ValueError(f"y dtype {y.dtype}, y_addend {None if y_addend is None else y_addend.dtype} != h dtype {h.dtype}")
    num_tokens, num_streams, hidden = h.shape
    num_slots = y.shape[1] if y.dim() == 3 else 0  # K routed slots, or 0: y is the block output itself
    if y.shape[0] != num_tokens or y.shape[-1] != hidden or (y.dim() == 3 and num_slots == 0):
        raise ValueError(f"y {tuple(y.shape)} for h {tuple(h.shape)}: [T, D] or [T, K >= 1, D]")
    y, h = y.contiguous(), h.contiguous()
    y_addend = None if y_addend is None else y_addend.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty_like(h)
    if num_tokens == 0:
        return out, None
    block_d = block_d or (256 if num_tokens <= 64 else 1024)
    num_d_blocks = triton.cdiv(hidden, block_d)
    grid = (num_tokens, num_d_blocks)
    partials = mix_args = None
    if next_fn is not None and num_tokens <= MAX_FUSED_MIX_TOKENS:
        if next_fn.dtype != torch.float32 or not next_fn.is_contiguous() or next_fn.shape[1] != num_streams * hidden:
            raise ValueError(f"next_fn {tuple(next_fn.shape)} {next_fn.dtype} is not a contiguous fp32 "
                             f"[M, {num_streams * hidden}]")
        block_m = triton.next_power_of_2(next_fn.shape[0])
        mix_part = torch.empty(num_d_blocks, num_tokens, block_m, dtype=torch.float32, device=h.device)
        sq_part = torch.empty(num_d_blocks, num_tokens, dtype=torch.float32, device=h.device)
        partials = MixPartials(out, next_fn, mix_part, sq_part, block_m)
        mix_args = {"next_fn_ptr": next_fn, "mix_part_ptr": mix_part, "sq_part_ptr": sq_part,
                    "num_mix": next_fn.shape[0], "BLOCK_M": block_m}
    _hc_post_kernel[grid](y, h, post, comb, out, hidden, N=num_streams, NP=triton.next_power_of_2(num_streams),
                          BLOCK_D=block_d, addend_ptr=y_addend, Y_SLOTS=num_slots, num_warps=4, **(mix_args or {}))
    return out, partials
