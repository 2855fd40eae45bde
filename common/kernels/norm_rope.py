"""Fused RMS norm + interleaved partial RoPE, one launch per call (docs/model.md §2.4).

Legend: R rows (tokens × heads), C channels per row, P = C − 2·H rotary pairs' start (nope width),
H = rope_dim / 2 pairs, T tokens (rows of cos/sin).

One program per row. The reference is the torch code in `common/model/{linear,rope}.py` and every
rounding of it is reproduced, so bf16 results match it up to fp32 summation order:
- weighted RMSNorm: y = (w · (x · rsqrt(mean x² + eps))).to(dtype)           (NormKind.WEIGHTED)
- unweighted:       y = (x · rsqrt(mean x² + eps).to(dtype)).to(dtype)        (NormKind.UNWEIGHTED: the
  scale is rounded to the row dtype before the product, as `unweighted_rms_norm` does)
- RoPE on the trailing 2·H channels, pairs (2i, 2i+1), fp32 rotation of the *normed, rounded* values,
  one more rounding; INVERSE rotates by −angle (the reference's `apply_rope(x, cos, -sin)`).
The rotary channels are re-read as even/odd vectors (strided) and normalised again with the same row
scale rather than shuffled in registers; they are ≤ 1/8 of a row here.
Writes a new tensor (callers keep their input). Graph-capturable: no host reads.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

class NormKind(enum.IntEnum):
    """The kernel's NORM constexpr."""

    NONE = 0
    UNWEIGHTED = 1
    WEIGHTED = 2


@triton.jit
def _normed(x, row_scale, weight_ptr, cols, col_mask, NORM: tl.constexpr, dtype: tl.constexpr):
    """x fp32 -> normed values rounded to dtype, returned as fp32."""
    y = x
    if NORM == 2:
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = (weight * (x * row_scale)).to(dtype).to(tl.float32)
    if NORM == 1:
        y = (x * row_scale.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return y


@triton.jit
def _norm_rope_kernel(x_ptr, out_ptr, weight_ptr, cos_ptr, sin_ptr, rows_per_token, num_channels, rope_half, eps,
                      NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
    # x [R, C] -> out [R, C]; cos/sin [T, H] fp32 with T = R / rows_per_token
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    row_ptr = x_ptr + row * num_channels
    cols = tl.arange(0, BLOCK_C)
    col_mask = cols < num_channels
    x = tl.load(row_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BC]
    row_scale = 1.0
    if NORM != 0:
        row_scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / num_channels + eps)
    y = _normed(x, row_scale, weight_ptr, cols, col_mask, NORM, dtype)
    nope = num_channels
    if ROPE:
        nope = num_channels - 2 * rope_half
    tl.store(out_ptr + row * num_channels + cols, y.to(dtype), mask=cols < nope)
    if ROPE:
        token = row // rows_per_token
        pairs = tl.arange(0, BLOCK_H)
        pair_mask = pairs < rope_half
        even_cols = nope + 2 * pairs
        odd_cols = even_cols + 1
        even = tl.load(row_ptr + even_cols, mask=pair_mask, other=0.0).to(tl.float32)
        odd = tl.load(row_ptr + odd_cols, mask=pair_mask, other=0.0).to(tl.float32)
        even = _normed(even, row_scale, weight_ptr, even_cols, pair_mask, NORM, dtype)
        odd = _normed(odd, row_scale, weight_ptr, odd_cols, pair_mask, NORM, dtype)
        cos = tl.load(cos_ptr + token * rope_half + pairs, mask=pair_mask, other=0.0)
        sin = tl.load(sin_ptr + token * rope_half + pairs, mask=pair_mask, other=0.0)
        if INVERSE:
            sin = -sin
        out_row = out_ptr + row * num_channels
        tl.store(out_row + even_cols, (even * cos - odd * sin).to(dtype), mask=pair_mask)
        tl.store(out_row + odd_cols, (odd * cos + even * sin).to(dtype), mask=pair_mask)


def _num_warps(block_c: int) -> int:
    return 1 if block_c <= 256 else 2 if block_c <= 1024 else 4 if block_c <= 4096 else 8


def norm_rope(
    x: torch.Tensor,  # [T, ..., C]
    *,
    norm: NormKind,
    eps: float = 0.0,
    weight: torch.Tensor | None = None,  # [C] (NormKind.WEIGHTED)
    cos: torch.Tensor | None = None,  # [T, H] fp32
    sin: torch.Tensor | None = None,  # [T, H] fp32
    inverse: bool = False,
) -> torch.Tensor:
    """Optional RMS norm of every row (last dim), then optional RoPE of its trailing 2·H channels.

    With cos/sin None no rotation is done. Returns a new tensor of x's shape and dtype.
    """
    if (norm is NormKind.WEIGHTED) != (weight is not None):
        raise ValueError("a weight is given exactly when norm is WEIGHTED")
    rope = cos is not None
    x = x.contiguous()
    out = torch.empty_like(x)
    num_channels = x.shape[-1]
    num_rows = x.numel() // num_channels if num_channels else 0
    if num_rows == 0:
        return out
    rope_half = 0
    rows_per_token = 1
    if rope:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        rope_half = cos.shape[-1]
        if cos.shape[0] != x.shape[0] or 2 * rope_half > num_channels:
            raise ValueError(f"cos {tuple(cos.shape)} does not fit x {tuple(x.shape)}")
        rows_per_token = num_rows // x.shape[0]
    weight_arg = weight.contiguous() if weight is not None else x  # never read without NORM_WEIGHTED
    block_c = triton.next_power_of_2(num_channels)
    _norm_rope_kernel[(num_rows,)](
        x, out, weight_arg, cos if rope else x, sin if rope else x, rows_per_token, num_channels, rope_half,
        float(eps), NORM=int(norm), ROPE=rope, INVERSE=inverse, BLOCK_C=block_c,
        BLOCK_H=triton.next_power_of_2(max(rope_half, 1)), num_warps=_num_warps(block_c))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same as `RMSNorm.forward` (weight fp32 [C])."""
    return norm_rope(x, norm=NormKind.WEIGHTED, eps=eps, weight=weight)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Same as `common.model.linear.unweighted_rms_norm`."""
    return norm_rope(x, norm=NormKind.UNWEIGHTED, eps=eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Same as `common.model.rope.apply_rope(x, cos, -sin if inverse else sin)`."""
    return norm_rope(x, norm=NormKind.NONE, cos=cos, sin=sin, inverse=inverse)
