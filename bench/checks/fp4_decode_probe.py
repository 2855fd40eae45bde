"""Exactness probe for the in-kernel FP4 decoders: dequantise a whole packed matrix with one of
them and compare with `reference.dequant_fp4` bit for bit (every code, every scale byte given).

Legend: N rows, K columns (K/2 packed bytes per row), BN rows per program, BK columns per program.

The decoders are exact by construction (LUT values times powers of two), so any difference,
even one ulp or a lost sign of zero, is a bug; a matmul check with a tolerance would hide that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dequant_tiles import fp4_tile, fp4_tile_halves
from moemesh.common.kernels.ptx_decode import (
    FOLDED_SCALE_SHIFT, fp4_scale_pairs, fp4_tile_halves_bf16_asm, fp4_tile_halves_bf16_folded_asm,
    fp4_tile_quarters_bf16_asm,
)
from moemesh.common.kernels.expert_configs import Fp4Decode
from moemesh.common.kernels.reference import dequant_fp4

BLOCK_N, BLOCK_K = 16, 64


@triton.jit
def _probe_kernel(w_ptr, s_ptr, out_ptr, stride_wn, stride_sn, stride_on,
                  DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k_begin = tl.program_id(1) * BLOCK_K
    mask_n = offs_n >= 0  # the grid covers N exactly
    if DECODE == 6:
        pairs = fp4_scale_pairs(s_ptr, offs_n, mask_n, k_begin, stride_sn, BLOCK_K)
        q0, q1, q2, q3 = fp4_tile_quarters_bf16_asm(w_ptr, pairs, offs_n, mask_n, k_begin, stride_wn, BLOCK_N, BLOCK_K)
        cols = k_begin + 4 * tl.arange(0, BLOCK_K // 4)  # [BK/4] k % 4 == 0
        base = out_ptr + offs_n[:, None] * stride_on + cols[None, :]
        tl.store(base, q0.to(tl.float32) * FOLDED_SCALE_SHIFT)
        tl.store(base + 1, q1.to(tl.float32) * FOLDED_SCALE_SHIFT)
        tl.store(base + 2, q2.to(tl.float32) * FOLDED_SCALE_SHIFT)
        tl.store(base + 3, q3.to(tl.float32) * FOLDED_SCALE_SHIFT)
    elif DECODE == 0:
        tile = fp4_tile(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_N, BLOCK_K)  # [BN, BK]
        cols = k_begin + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + offs_n[:, None] * stride_on + cols[None, :], tile)
    else:
        factor = 1.0
        if DECODE == 4:
            even, odd = fp4_tile_halves_bf16_asm(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn,
                                                 BLOCK_N, BLOCK_K)
        elif DECODE == 5:
            even, odd = fp4_tile_halves_bf16_folded_asm(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn,
                                                        BLOCK_N, BLOCK_K)
            factor = FOLDED_SCALE_SHIFT
        else:
            even, odd = fp4_tile_halves(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_N, BLOCK_K)
        cols = k_begin + 2 * tl.arange(0, BLOCK_K // 2)  # [BK/2] even k
        base = out_ptr + offs_n[:, None] * stride_on + cols[None, :]
        tl.store(base, even.to(tl.float32) * factor)
        tl.store(base + 1, odd.to(tl.float32) * factor)


def decode_matrix(packed: torch.Tensor, scale: torch.Tensor, decode: Fp4Decode) -> torch.Tensor:
    """fp32 [N, K] decoded by the kernel helper of `decode` (JOIN, HALVES, ASM, ASM_FOLDED or ASM_QUAD)."""
    num_rows, num_bytes = packed.shape
    if num_rows % BLOCK_N or (2 * num_bytes) % BLOCK_K:
        raise ValueError(f"shape {tuple(packed.shape)} must tile by {BLOCK_N} x {BLOCK_K // 2}")
    if decode not in (Fp4Decode.JOIN, Fp4Decode.HALVES, Fp4Decode.ASM, Fp4Decode.ASM_FOLDED, Fp4Decode.ASM_QUAD):
        raise ValueError(f"{decode.name} has no standalone decoder")
    out = torch.empty(num_rows, 2 * num_bytes, dtype=torch.float32, device=packed.device)
    grid = (num_rows // BLOCK_N, 2 * num_bytes // BLOCK_K)
    _probe_kernel[grid](packed, scale, out, packed.stride(0), scale.stride(0), out.stride(0),
                        DECODE=int(decode), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def all_codes_case(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value (so every nibble pair) against scale bytes 100..140, [48, 256] bytes."""
    num_rows, num_bytes = 48, 256
    packed = (torch.arange(num_rows * num_bytes, dtype=torch.int64) * 7 % 256).to(torch.uint8)
    scale = (100 + torch.arange(num_rows * num_bytes // 16) % 41).to(torch.uint8)
    return packed.reshape(num_rows, num_bytes).to(device), scale.reshape(num_rows, num_bytes // 16).to(device)


def mismatches(decode: Fp4Decode, device: str) -> int:
    """Number of elements whose bits differ from the reference (0 when the decoder is exact)."""
    packed, scale = all_codes_case(device)
    got = decode_matrix(packed, scale, decode).cpu()
    want = dequant_fp4(packed.cpu(), scale.cpu()).to(torch.float32)
    return int((got.view(torch.int32) != want.view(torch.int32)).sum())
