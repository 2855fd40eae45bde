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
  each weight byte is read once; fp32 partials [S, T, N] are summed by torch afterwards.
- prefill: 128x128 output tiles over the full K, no split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.kernels.reference import FP8_BLOCK_SIZE, scale_bytes

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

    def __post_init__(self) -> None:
        if FP8_BLOCK_SIZE % self.block_k != 0:
            raise ValueError(f"block_k {self.block_k} must divide {FP8_BLOCK_SIZE}")
        if min(self.block_n, self.block_t, self.block_k) < 16:
            raise ValueError("every tile side must be at least 16 (tl.dot)")
        if self.split_k < 1:
            raise ValueError("split_k must be >= 1")


@functools.lru_cache(maxsize=16)
def device_num_sms(device: torch.device) -> int:
    """Cached: the property query costs tens of microseconds, more than a decode-size kernel."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def choose_fp8_linear_config(
    num_tokens: int, out_features: int, in_features: int, num_sms: int = DEFAULT_NUM_SMS
) -> Fp8LinearConfig:
    """Heuristic schedule; see the module docstring. Benchmarked alternatives live in bench/kernels.py."""
    if num_tokens > DECODE_MAX_TOKENS:
        # Measured on an H200 at T=2048 (bench/NOTES.md): BK=64 with 4 stages wins from N=2048 up;
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
    x_ptr, w_ptr, s_ptr, out_ptr,
    num_tokens, out_features, in_features,
    stride_xt, stride_wn, stride_sn, stride_os, stride_ot,
    K_STEPS_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, QUANT_BLOCK: tl.constexpr,
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

    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)  # y^T tile
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
        s_bytes = tl.load(s_ptr + scale_rows * stride_sn + (k_step * BLOCK_K) // QUANT_BLOCK, mask=mask_n, other=127)
        scale = (s_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # [BN] 2^(byte-127)
        w = w_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    out_ptrs = out_ptr + pid_s * stride_os + offs_t[None, :] * stride_ot + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_t[None, :])


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
    2^128: neither occurs in real checkpoints.
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
        config = choose_fp8_linear_config(num_tokens, num_out, num_in, device_num_sms(x.device))
    k_steps = triton.cdiv(num_in, config.block_k)
    k_steps_per_split = triton.cdiv(k_steps, config.split_k)
    split_k = triton.cdiv(k_steps, k_steps_per_split)
    if split_k == 1:
        out = torch.empty(num_tokens, num_out, dtype=out_dtype, device=x.device)
    else:
        out = torch.empty(split_k, num_tokens, num_out, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_out, config.block_n), triton.cdiv(num_tokens, config.block_t), split_k)
    _fp8_linear_kernel[grid](
        x2d, w_bytes, s_bytes, out,
        num_tokens, num_out, num_in,
        x2d.stride(0), w_bytes.stride(0), s_bytes.stride(0),
        out.stride(0) if split_k > 1 else 0, out.stride(-2),
        K_STEPS_PER_SPLIT=k_steps_per_split, BLOCK_N=config.block_n, BLOCK_T=config.block_t, BLOCK_K=config.block_k, QUANT_BLOCK=FP8_BLOCK_SIZE,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split_k > 1:
        out = out.sum(0).to(out_dtype)
    return out.reshape(*lead_shape, num_out)
