"""y = x @ W^T with W FP8 e4m3 [N, K] and ue8m0 128x128 block scales, dequantised in the kernel.

Legend: T tokens (rows of x), N output features, K input features, S split-K parts.

The weight stays FP8 in device memory (1 byte per element) and is converted to the activation
dtype in registers; each 128x128 block's scale is a power of two, so folding it into the
converted weight is exact (bf16 and fp32 share fp32's exponent range). Accumulation is fp32.

The kernel computes the transposed tile y^T [N-tile, T-tile] = W_tile @ x_tile^T, so the
dequantised weight is the left dot operand: on Hopper that operand can stay in registers
(wgmma's A) while x goes through shared memory, and the token dimension, which is tiny in decode,
is the narrow side of the tile (minimum 16).

Schedules (`choose_fp8_linear_config`):
- decode (T <= 64): narrow N tiles and split-K, so that there are at least ~2 programs per SM and
  each weight byte is read once. Split-K stays one launch: each program writes its fp32 partial
  [T, N-tile] into a workspace [S, T, N], and the last program of the tile to arrive sums the S
  partials in a fixed order and stores the output (`split_k.py`); no second kernel.
- prefill: 128x128 output tiles over the full K, no split.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.ptx_decode import fp8_tile_bf16_asm, fp8_tile_quarters_bf16_asm
from moemesh.common.kernels.reference import FP8_BLOCK_SIZE, scale_bytes
from moemesh.common.kernels.split_k import take_ticket, tile_counters

DECODE_MAX_TOKENS = 64
DEFAULT_NUM_SMS = 132  # H200/H100 SXM; used when no CUDA device answers (the interpreter)


@dataclass(frozen=True)
class Fp8LinearConfig:
    """Tile shape and launch parameters. `block_k` must divide 128 (one scale per K step)."""

    block_n: int
    block_t: int
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_fma: bool = False  # fp32 multiply-add + reduction over k instead of tl.dot (GEMV, block_t >= 1)
    asm_decode: bool = False  # e4m3 -> bf16 by inline PTX (GPU only, bf16 x, tl.dot; `dequant_tiles.fp8_tile_bf16_asm`)
    asm_quad: bool = False  # with asm_decode: codes read as uint32, four dots by k mod 4 (`fp8_tile_quarters_bf16_asm`)

    def __post_init__(self) -> None:
        if FP8_BLOCK_SIZE % self.block_k != 0:
            raise ValueError(f"block_k {self.block_k} must divide {FP8_BLOCK_SIZE}")
        min_t = 1 if self.use_fma else 16
        if min(self.block_n, self.block_k) < 16 or self.block_t < min_t:
            raise ValueError(f"block_n and block_k must be at least 16, block_t at least {min_t} (tl.dot)")
        if self.block_t & (self.block_t - 1):
            raise ValueError("block_t must be a power of two")
        if self.asm_decode and self.use_fma:
            raise ValueError("asm_decode feeds tl.dot; it does not combine with use_fma")
        if self.split_k < 1:
            raise ValueError("split_k must be >= 1")


@functools.lru_cache(maxsize=16)
def device_num_sms(device: torch.device) -> int:
    """Cached: the property query costs tens of microseconds, more than a decode-size kernel."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


# Whether the inline-PTX e4m3 decode (asm_decode + asm_quad) is the default, per bucket, where it
# can run (bf16 activations, compiled kernels, K a multiple of 4). Measured on an H200
# (kernels-fp8-h200x2-20261129T212201Z.json, docs/performance.md): decode T=64 equal or 3-9 % faster on all six
# V4-Flash shapes, T=1 2-5 % faster on four (wq_a 5.8 -> 6.1 us slower); prefill T=2048 8-65 % slower.
PTX_DECODE_BY_DEFAULT = {"decode": True, "prefill": False}


def choose_fp8_linear_config(
    num_tokens: int, out_features: int, in_features: int, num_sms: int = DEFAULT_NUM_SMS, *,
    ptx_decode_possible: bool = False,
) -> Fp8LinearConfig:
    """Heuristic schedule; see the module docstring. Benchmarked alternatives live in bench/kernels.py."""
    config = _heuristic_tiles(num_tokens, out_features, in_features, num_sms)
    bucket = "prefill" if num_tokens > DECODE_MAX_TOKENS else "decode"
    if ptx_decode_possible and PTX_DECODE_BY_DEFAULT[bucket]:
        config = dataclasses.replace(config, asm_decode=True, asm_quad=True)
    return config


def _heuristic_tiles(num_tokens: int, out_features: int, in_features: int, num_sms: int) -> Fp8LinearConfig:
    if num_tokens > DECODE_MAX_TOKENS:
        # Measured on an H200 at T=2048 (docs/performance.md): BK=64 with 4 stages wins from N=2048 up;
        # N<=512 needs narrower tiles to fill the SMs.
        if out_features <= 512:
            return Fp8LinearConfig(block_n=64, block_t=128, block_k=128, split_k=1, num_warps=4, num_stages=4)
        if out_features >= 2048:
            return Fp8LinearConfig(block_n=128, block_t=128, block_k=64, split_k=1, num_warps=8, num_stages=4)
        return Fp8LinearConfig(block_n=128, block_t=128, block_k=128, split_k=1, num_warps=8, num_stages=3)
    block_t = max(16, triton.next_power_of_2(num_tokens))
    block_n = 64
    num_n_tiles = triton.cdiv(out_features, block_n)
    num_k_steps = triton.cdiv(in_features, 128)
    wanted_split = max(1, min(num_k_steps, triton.cdiv(2 * num_sms, num_n_tiles)))
    k_steps_per_split = triton.cdiv(num_k_steps, wanted_split)
    split_k = triton.cdiv(num_k_steps, k_steps_per_split)  # no empty split
    return Fp8LinearConfig(block_n=block_n, block_t=block_t, block_k=128, split_k=split_k, num_warps=4, num_stages=4)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, partial_ptr, counter_ptr,
    num_tokens, out_features, in_features,
    stride_xt, stride_wn, stride_sn, stride_ot, stride_ps, stride_pt,
    SPLIT_K: tl.constexpr, K_STEPS_PER_SPLIT: tl.constexpr, USE_FMA: tl.constexpr, ASM_DECODE: tl.constexpr, ASM_QUAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, QUANT_BLOCK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    mask_n = offs_n < out_features
    mask_t = offs_t < num_tokens
    scale_rows = offs_n // QUANT_BLOCK  # [BN]

    WIDE: tl.constexpr = USE_FMA and BLOCK_T == 1
    acc = tl.zeros([BLOCK_N, BLOCK_K if WIDE else BLOCK_T], dtype=tl.float32)  # y^T tile (or its k-partials)
    # Every split runs the same trip count, a compile-time constant (fixed per layer shape, so few
    # variants get compiled); steps past K (last split only) load nothing (masked).
    for step in range(0, K_STEPS_PER_SPLIT):
        k_step = pid_s * K_STEPS_PER_SPLIT + step
        k = k_step * BLOCK_K + offs_k
        mask_k = k < in_features
        w_bytes = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0
        )  # [BN, BK] e4m3 bytes
        x = tl.load(
            x_ptr + offs_t[:, None] * stride_xt + k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0
        )  # [BT, BK]
        if ASM_QUAD:
            q0, q1, q2, q3 = fp8_tile_quarters_bf16_asm(w_ptr, s_ptr, offs_n, mask_n, k_step * BLOCK_K, in_features,
                                                        stride_wn, stride_sn, BLOCK_K)  # [BN, BK/4] each
            x_b0, x_b1 = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_K // 4, 2, 2]))  # k % 2 == 0 / 1
            x_0, x_2 = tl.split(x_b0)  # k % 4 == 0 / 2: [BT, BK/4]
            x_1, x_3 = tl.split(x_b1)
            acc = tl.dot(q0, tl.trans(x_0), acc)
            acc = tl.dot(q1, tl.trans(x_1), acc)
            acc = tl.dot(q2, tl.trans(x_2), acc)
            acc = tl.dot(q3, tl.trans(x_3), acc)
        elif ASM_DECODE:
            w_bf16 = fp8_tile_bf16_asm(w_ptr, s_ptr, offs_n, mask_n, k_step * BLOCK_K, in_features, stride_wn,
                                       stride_sn, BLOCK_K)  # [BN, BK] bf16
            acc = tl.dot(w_bf16, tl.trans(x), acc)
        else:
            s_bytes = tl.load(s_ptr + scale_rows * stride_sn + (k_step * BLOCK_K) // QUANT_BLOCK, mask=mask_n,
                              other=127)
            scale = (s_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # [BN] 2^(byte-127)
            w = w_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
            if USE_FMA and BLOCK_T == 1:  # one token: elementwise partial sums, reduced after the loop
                acc += w * x.to(tl.float32)
            elif USE_FMA:  # [BN, 1, BK] * [1, BT, BK] summed over k
                acc += tl.sum(w[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
            else:
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    if WIDE:
        acc = tl.sum(acc, axis=1)[:, None]  # [BN, 1]
    store_mask = mask_n[:, None] & mask_t[None, :]  # [BN, BT]
    if SPLIT_K > 1:
        part_offs = offs_t[None, :] * stride_pt + offs_n[:, None]  # [BN, BT]
        tl.store(partial_ptr + pid_s * stride_ps + part_offs, acc, mask=store_mask)
        tile = pid_n * tl.num_programs(1) + pid_t
        is_last = take_ticket(counter_ptr + tile, SPLIT_K)
        store_mask = store_mask & is_last
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # fixed order: deterministic sum
            acc += tl.load(partial_ptr + s * stride_ps + part_offs, mask=store_mask, other=0.0, cache_modifier=".cg")
    out_ptrs = out_ptr + offs_t[None, :] * stride_ot + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    config: Fp8LinearConfig | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ dequant(weight [N, K] FP8, scale [ceil(N/128), ceil(K/128)])^T.

    Returns [..., N] in `out_dtype` (default x.dtype). The weight may be float8_e4m3fn or its uint8
    bytes; scales float8_e8m0fnu or uint8. Scale byte 0 (2^-127) is read as 0 and 255 (NaN) as
    2^128: neither occurs in real checkpoints. With the inline-PTX decode (the default for bf16
    activations on the GPU, `PTX_DECODE_BY_DEFAULT`) results are exact for scale bytes <= 134,
    i.e. weights below 2^7 * 448 in magnitude (real checkpoints: scale bytes ~110..125).
    """
    num_out, num_in = weight.shape
    if x.shape[-1] != num_in:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {num_in}")
    lead_shape = x.shape[:-1]
    x2d = x.reshape(-1, num_in)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    w_bytes = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    if w_bytes.stride(-1) != 1:
        w_bytes = w_bytes.contiguous()
    s_bytes = scale_bytes(scale).contiguous()
    num_tokens = x2d.shape[0]
    out_dtype = out_dtype or x.dtype
    if config is None:
        ptx_possible = (x2d.dtype == torch.bfloat16 and x2d.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
                        and num_in % 4 == 0 and w_bytes.stride(0) % 4 == 0)
        config = choose_fp8_linear_config(num_tokens, num_out, num_in, device_num_sms(x.device),
                                          ptx_decode_possible=ptx_possible)
    if config.asm_decode and (x2d.dtype != torch.bfloat16 or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError("asm_decode needs bf16 activations and a compiled (not interpreted) kernel")
    if config.asm_decode and config.asm_quad and (num_in % 4 or w_bytes.stride(0) % 4):
        raise ValueError("asm_quad reads the weight as 32-bit words: K and the row stride must be multiples of 4")
    k_steps = triton.cdiv(num_in, config.block_k)
    k_steps_per_split = triton.cdiv(k_steps, config.split_k)
    split_k = triton.cdiv(k_steps, k_steps_per_split)
    out = torch.empty(num_tokens, num_out, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(num_out, config.block_n), triton.cdiv(num_tokens, config.block_t), split_k)
    if split_k > 1:
        partials = torch.empty(split_k, num_tokens, num_out, dtype=torch.float32, device=x.device)
        counters = tile_counters(x.device, grid[0] * grid[1])
    else:
        partials, counters = out, s_bytes  # never read
    _fp8_linear_kernel[grid](
        x2d, w_bytes, s_bytes, out, partials, counters,
        num_tokens, num_out, num_in,
        x2d.stride(0), w_bytes.stride(0), s_bytes.stride(0), out.stride(0),
        partials.stride(0) if split_k > 1 else 0, partials.stride(1) if split_k > 1 else 0,
        SPLIT_K=split_k, K_STEPS_PER_SPLIT=k_steps_per_split, USE_FMA=config.use_fma, ASM_DECODE=config.asm_decode,
        ASM_QUAD=config.asm_decode and config.asm_quad, BLOCK_N=config.block_n, BLOCK_T=config.block_t, BLOCK_K=config.block_k, QUANT_BLOCK=FP8_BLOCK_SIZE,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out.reshape(*lead_shape, num_out)
