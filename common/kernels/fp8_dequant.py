"""FP8 linears at prefill sizes: dequantise the weight to bf16 once, then cuBLAS.

Legend: T tokens, N out features, K in features.

Why: the fused `fp8_linear` kernel converts each weight tile in its main loop and reaches 47-54 % of
the bf16 matmul rate at T = 2048, where cuBLAS on a bf16 weight is ~2x faster (docs/performance.md,
"fp8_linear" run 2: wq_b 360 vs 197 us, wo_b 320 vs 168 us). Dequantising a 33.5 MB FP8 matrix costs
~25 us (33.5 MB read, 67 MB written), so above ~1K tokens the bf16 copy pays for itself many times.
The copy is transient (one matrix at a time, freed after the call): the model stays FP8 on the
device. No host sync, so a captured step may take either path.

Numerics: e4m3 x 2^k is exact in bf16, so the two paths multiply the same values; both accumulate in
fp32 and round once at the output (cuBLAS's own summation order).
"""

from __future__ import annotations

import enum
import os

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dequant_tiles import fp8_tile
from moemesh.common.kernels.reference import FP8_BLOCK_SIZE

PATH_ENV = "MOEMESH_FP8_PREFILL"
MIN_TOKENS = 1024  # at and above: dequantise + cuBLAS (measured faster from here; docs/performance.md)
BLOCK_N = 64
BLOCK_K = 128


class Fp8PrefillPath(enum.Enum):
    KERNEL = "kernel"  # always the fused fp8_linear kernel
    DEQUANT = "dequant"  # always dequantise + torch matmul (bf16/fp16 activations)
    AUTO = "auto"  # dequantise from MIN_TOKENS tokens up


def fp8_prefill_path() -> Fp8PrefillPath:
    """Read per call (`MOEMESH_FP8_PREFILL`), so one benchmark process can compare the paths."""
    value = os.environ.get(PATH_ENV, "").strip().lower()
    return Fp8PrefillPath(value) if value else Fp8PrefillPath.AUTO


def use_dequant_linear(num_tokens: int) -> bool:
    path = fp8_prefill_path()
    return path is Fp8PrefillPath.DEQUANT or (path is Fp8PrefillPath.AUTO and num_tokens >= MIN_TOKENS)


@triton.jit
def _dequant_fp8_kernel(w_ptr, s_ptr, out_ptr, num_rows, num_cols, stride_wn, stride_sn, stride_on,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < num_rows
    k_begin = tl.program_id(1) * BLOCK_K
    tile = fp8_tile(w_ptr, s_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, stride_sn, BLOCK_K)  # [BN, BK] fp32
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    out_ptrs = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :]
    tl.store(out_ptrs, tile.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & (offs_k[None, :] < num_cols))


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight e4m3 (or its bytes) [N, K], ue8m0 scale bytes [ceil(N/128), ceil(K/128)] -> dtype [N, K]."""
    num_rows, num_cols = weight.shape
    w_bytes = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    s_bytes = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    if s_bytes.shape != (triton.cdiv(num_rows, FP8_BLOCK_SIZE), triton.cdiv(num_cols, FP8_BLOCK_SIZE)):
        raise ValueError(f"scale {tuple(s_bytes.shape)} does not match weight {tuple(weight.shape)}")
    w_bytes, s_bytes = w_bytes.contiguous(), s_bytes.contiguous()
    out = torch.empty(num_rows, num_cols, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(num_rows, BLOCK_N), triton.cdiv(num_cols, BLOCK_K))
    _dequant_fp8_kernel[grid](w_bytes, s_bytes, out, num_rows, num_cols, w_bytes.stride(0), s_bytes.stride(0),
                              out.stride(0), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out


def fp8_linear_dequant(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16/fp16 -> [..., N] in x's dtype: `fp8_linear` through a transient 16-bit weight."""
    return torch.nn.functional.linear(x, dequant_fp8(weight, scale, x.dtype))
