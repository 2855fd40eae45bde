"""Fused mHC kernels (docs/model.md §2.2): `hc_pre` and `hc_head` in two launches, or one where the launch that
wrote the streams did the first (`mhc_streams`: hc_post and the embedding).

Legend: T tokens, N streams (hc_mult), NP N padded to a power of two, D hidden, K = N·D flattened
stream width, M mix rows ((2 + N)·N for hc_pre, N for hc_head), BM M padded, S split-K parts.

The torch functions in `common/model/hyper.py` are the reference; these compute the same function:
- launch 1 (grid [T/BT, S]): per token and K slice, the partial mix Σ_k h[t, k]·fn[m, k] and the
  partial Σ_k h[t, k]² (fp32, one read of h and of fn). The RMS normalisation is a per-token scalar,
  so it is applied after the GEMV: mix = rsqrt(mean h² + eps)·(h·fnᵀ). Decode (T ≤ 16) uses
  `_mix_gemv_kernel` (one token per program, fp32 multiply-adds); larger T `_mix_partials_kernel`
  (`tl.dot`: fp32 FMA, tf32x3, or bf16x3 = fn split in three bf16 pieces so every tensor-core
  product is exact when h is bf16).
- launch 2 (`_hc_finish_kernel`, grid [T, D/BD + 1]): sums the S partials; each D-slice program applies the
  sigmoid to pre and writes x[t, d] = Σ_n pre_n·h[t, n, d] for its slice, and one more program per token
  computes post and comb (softmax, then the full Sinkhorn on the NP×NP matrix in registers), beside them:
  the Sinkhorn's serial chain is not on x's path, and post / comb are read only by the block's hc_post.
  hc_head runs the same two launches with HEAD=True (no post/comb, no extra program).
No launch reads a value on the host or sizes a buffer from data: all of it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dependent_launch import dependent_launch, wait_for_inputs
from moemesh.common.kernels.mhc_streams import MixPartials

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
                     K_STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
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
                         PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
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
                      APPROX_DIV: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
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
    if not HEAD and pid_d == tl.num_programs(1) - 1:  # the last program: post and comb, off x's path
        post_mix = _sum_parts_1d(part_row, N + streams, stream_mask, split_offsets, split_mask) * inv_rms
        post_logit = post_mix * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + streams, mask=stream_mask, other=0.0)
        tl.store(post_ptr + pid_t * N + streams, 2.0 * tl.sigmoid(post_logit), mask=stream_mask)
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
        tl.store(comb_ptr + pid_t * N * N + pair, comb, mask=pair_mask)
    else:  # x over this program's D slice
        # the streams' slice is loaded first: its latency overlaps the partial sums
        dims = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        dim_mask = dims < hidden
        tile = tl.load(h_ptr + pid_t.to(tl.int64) * num_cols + streams[:, None] * hidden + dims[None, :],
                       mask=stream_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)  # [NP, BD]
        pre_mix = _sum_parts_1d(part_row, streams, stream_mask, split_offsets, split_mask) * inv_rms  # [NP]
        pre = tl.sigmoid(pre_mix * tl.load(scale_ptr) + tl.load(base_ptr + streams, mask=stream_mask, other=0.0))
        pre = tl.where(stream_mask, pre + hc_eps, 0.0)
        x = tl.sum(pre[:, None] * tile, axis=0)
        if OUT_NORM:  # RMSNorm(x) of the rounded x, as the block's attn_norm / ffn_norm; BLOCK_D covers D
            x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
            out_scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + out_eps)
            x = tl.load(out_weight_ptr + dims, mask=dim_mask, other=0.0) * (x * out_scale)
        tl.store(x_ptr + pid_t.to(tl.int64) * hidden + dims, x.to(x_ptr.dtype.element_ty), mask=dim_mask)


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
                               BLOCK_M=block_m, BLOCK_K=config.block_k, num_warps=config.num_warps,
                               **dependent_launch(h.device))
    else:
        _mix_partials_kernel[grid](h, fn, mix_part, sq_part, num_tokens, num_cols, num_mix, K_STEPS=k_steps,
                                   BLOCK_T=config.block_t, BLOCK_M=block_m, BLOCK_K=config.block_k,
                                   PRECISION=config.precision, num_warps=config.num_warps, **dependent_launch(h.device))
    return mix_part, sq_part, block_m


def _finish(h, mix_part, sq_part, block_m, base, scale, x, post, comb, num_sinkhorn_iters, hc_eps, norm_eps,
            config: MixConfig, head: bool, out_norm: tuple[torch.Tensor, float] | None) -> None:
    num_tokens, num_streams, hidden = h.shape
    block_d, num_warps = config.block_d, config.finish_num_warps
    if out_norm is not None:  # the norm needs the whole row in one program
        block_d = triton.next_power_of_2(hidden)
        num_warps = max(num_warps, min(8, block_d // 512))
    out_weight, out_eps = out_norm if out_norm is not None else (x, 0.0)
    grid = (num_tokens, triton.cdiv(hidden, block_d) + (0 if head else 1))  # hc_pre: one more program, post and comb
    _hc_finish_kernel[grid](h, mix_part, sq_part, base, scale, x, post, comb, out_weight,
                            num_tokens, hidden, config.num_splits, float(hc_eps), float(norm_eps), float(out_eps),
                            SINKHORN_ITERS=num_sinkhorn_iters, N=num_streams, NP=triton.next_power_of_2(num_streams),
                            BLOCK_M=block_m, BLOCK_S=triton.next_power_of_2(config.num_splits),
                            BLOCK_D=block_d, HEAD=head, OUT_NORM=out_norm is not None,
                            APPROX_DIV=config.approx_division, num_warps=num_warps, **dependent_launch(h.device))


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
