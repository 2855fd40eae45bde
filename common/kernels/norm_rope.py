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

Angles without cos/sin tensors: `rope_cos_sin` computes (cos, sin) of positions · ω in one launch, and
`window_rows_norm_rope` rotates compressed rows at their window's first position, computing the angles
itself from the closing tokens' positions (and rounding the fp32 pooled rows to the output dtype first,
as the torch path's cast does). Both take the fp32 product position · ω as `RotaryTable.cos_sin` does,
and `tl.cos` / `tl.sin` are libdevice's cosf / sinf, the functions torch's CUDA cos and sin call.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dependent_launch import dependent_launch, wait_for_inputs


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
def rotate_pairs(even, odd, cos, sin):
    """(even, odd) fp32 pairs rotated by (cos, sin): (e·cos − o·sin, o·cos + e·sin) in fp32. The fused
    multiply-adds are spelled out so that every kernel rotating a pair rounds it the same way (left to
    the compiler, which product a kernel fuses depends on its surroundings)."""
    return tl.fma(even, cos, -(odd * sin)), tl.fma(odd, cos, even * sin)


@triton.jit
def _norm_rope_row(row_ptr, out_row_ptr, weight_ptr, cos, sin, num_channels, rope_half, eps,
                   NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, IN_PLACE: tl.constexpr = False):
    """One row [C]: values rounded to the output dtype as read (a no-op for rows already in it), optional
    norm, optional rotation of the trailing 2·H channels by (cos, sin) [BH] fp32. Every load comes before the
    first store; IN_PLACE (out_row_ptr == row_ptr) puts a barrier between them, since a value can be held
    (and loaded) by several threads."""
    dtype = out_row_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_C)
    col_mask = cols < num_channels
    x = tl.load(row_ptr + cols, mask=col_mask, other=0.0).to(dtype).to(tl.float32)  # [BC]
    nope = num_channels
    if ROPE:
        nope = num_channels - 2 * rope_half
    pairs = tl.arange(0, BLOCK_H)
    pair_mask = pairs < rope_half
    even_cols = nope + 2 * pairs
    odd_cols = even_cols + 1
    if ROPE:
        even = tl.load(row_ptr + even_cols, mask=pair_mask, other=0.0).to(dtype).to(tl.float32)
        odd = tl.load(row_ptr + odd_cols, mask=pair_mask, other=0.0).to(dtype).to(tl.float32)
    row_scale = 1.0
    if NORM != 0:
        row_scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / num_channels + eps)
    y = _normed(x, row_scale, weight_ptr, cols, col_mask, NORM, dtype)
    if IN_PLACE:
        tl.debug_barrier()
    tl.store(out_row_ptr + cols, y.to(dtype), mask=cols < nope)
    if ROPE:
        even = _normed(even, row_scale, weight_ptr, even_cols, pair_mask, NORM, dtype)
        odd = _normed(odd, row_scale, weight_ptr, odd_cols, pair_mask, NORM, dtype)
        if INVERSE:
            sin = -sin
        new_even, new_odd = rotate_pairs(even, odd, cos, sin)
        tl.store(out_row_ptr + even_cols, new_even.to(dtype), mask=pair_mask)
        tl.store(out_row_ptr + odd_cols, new_odd.to(dtype), mask=pair_mask)


@triton.jit
def _norm_rope_kernel(x_ptr, out_ptr, weight_ptr, cos_ptr, sin_ptr, rows_per_token, num_channels, rope_half, eps,
                      NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    # x [R, C] -> out [R, C]; cos/sin [T, H] fp32 with T = R / rows_per_token
    row = tl.program_id(0).to(tl.int64)
    pairs = tl.arange(0, BLOCK_H)
    cos = tl.zeros([BLOCK_H], dtype=tl.float32)
    sin = tl.zeros([BLOCK_H], dtype=tl.float32)
    if ROPE:
        token = row // rows_per_token
        cos = tl.load(cos_ptr + token * rope_half + pairs, mask=pairs < rope_half, other=0.0)
        sin = tl.load(sin_ptr + token * rope_half + pairs, mask=pairs < rope_half, other=0.0)
    _norm_rope_row(x_ptr + row * num_channels, out_ptr + row * num_channels, weight_ptr, cos, sin, num_channels,
                   rope_half, eps, NORM, ROPE, INVERSE, BLOCK_C, BLOCK_H)


@triton.jit
def _window_rows_norm_rope_kernel(x_ptr, out_ptr, weight_ptr, inv_freq_ptr, positions_ptr, tokens_ptr, num_channels,
                                  rope_half, eps, RATIO: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                                  USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    # x [Nc, C] (pooled rows, any float dtype) -> out [Nc, C]; row i rotated at positions[tokens[i]] // m · m
    row = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + tl.load(tokens_ptr + row))
    window_start = (position // RATIO) * RATIO  # positions are >= 0: truncation is the floor
    pairs = tl.arange(0, BLOCK_H)
    inv_freq = tl.load(inv_freq_ptr + pairs, mask=pairs < rope_half, other=0.0)
    angles = window_start.to(tl.float32) * inv_freq  # [BH], as `RotaryTable.cos_sin`
    _norm_rope_row(x_ptr + row * num_channels, out_ptr + row * num_channels, weight_ptr, tl.cos(angles),
                   tl.sin(angles), num_channels, rope_half, eps, 2, True, False, BLOCK_C, BLOCK_H)


@triton.jit
def _cos_sin_kernel(positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, num_positions, rope_half,
                    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    # positions [N] int, inv_freq [K, H] -> cos, sin [K, N, H] fp32 of positions · inv_freq[k]; grid (N / BR, K)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    table = tl.program_id(1).to(tl.int64)
    pairs = tl.arange(0, BLOCK_H)  # [BH]
    row_mask = rows < num_positions
    pair_mask = pairs < rope_half
    positions = tl.load(positions_ptr + rows, mask=row_mask, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + table * rope_half + pairs, mask=pair_mask, other=0.0)
    angles = positions[:, None] * inv_freq[None, :]  # [BR, BH]
    offsets = (table * num_positions + rows[:, None].to(tl.int64)) * rope_half + pairs[None, :]
    mask = row_mask[:, None] & pair_mask[None, :]
    tl.store(cos_ptr + offsets, tl.cos(angles), mask=mask)
    tl.store(sin_ptr + offsets, tl.sin(angles), mask=mask)


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
        BLOCK_H=triton.next_power_of_2(max(rope_half, 1)), num_warps=_num_warps(block_c), **dependent_launch(x.device))
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


def window_rows_norm_rope(
    x: torch.Tensor,  # [Nc, C] pooled rows (fp32)
    *,
    weight: torch.Tensor,  # [C] fp32
    eps: float,
    inv_freq: torch.Tensor,  # [H] fp32
    positions: torch.Tensor,  # [T] int, every token of the forward
    tokens: torch.Tensor,  # [Nc] int, flat index of the token that closed each row's window
    ratio: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Rows of closed compression windows -> `norm_rope(x.to(out_dtype), WEIGHTED, cos, sin)` at each window's
    first position (positions[tokens] // ratio · ratio), the angles computed in the launch from `inv_freq`:
    one launch for what the torch path does in nine (gather, floor-divide, multiply, cast, angles, cos, sin,
    the cast of x, norm + RoPE). Returns [Nc, C] in out_dtype."""
    num_rows, num_channels = x.shape
    rope_half = inv_freq.shape[0]
    if tokens.shape != (num_rows,) or 2 * rope_half > num_channels or weight.shape != (num_channels,):
        raise ValueError(f"x {tuple(x.shape)}, tokens {tuple(tokens.shape)}, inv_freq {tuple(inv_freq.shape)} "
                         f"and weight {tuple(weight.shape)} do not fit")
    x = x.contiguous()
    out = torch.empty(num_rows, num_channels, dtype=out_dtype, device=x.device)
    if num_rows == 0:
        return out
    block_c = triton.next_power_of_2(num_channels)
    _window_rows_norm_rope_kernel[(num_rows,)](
        x, out, weight.contiguous(), inv_freq.float().contiguous(), positions.contiguous(), tokens.contiguous(),
        num_channels, rope_half, float(eps), RATIO=ratio, BLOCK_C=block_c,
        BLOCK_H=triton.next_power_of_2(rope_half), num_warps=_num_warps(block_c), **dependent_launch(x.device))
    return out


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, block_rows: int = 16
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] int, inv_freq [H] (or [K, H]: K tables) fp32 -> (cos, sin) [N, H] (or [K, N, H]) fp32 of the
    fp32 angles positions · inv_freq, one launch (`RotaryTable.cos_sin` in torch is four per table: cast,
    multiply, cos, sin)."""
    num_positions, rope_half = positions.shape[0], inv_freq.shape[-1]
    num_tables = 1 if inv_freq.dim() == 1 else inv_freq.shape[0]
    cos = torch.empty(*inv_freq.shape[:-1], num_positions, rope_half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if num_positions == 0 or num_tables == 0:
        return cos, sin
    block_h = triton.next_power_of_2(rope_half)
    block_rows = min(block_rows, triton.next_power_of_2(num_positions))
    _cos_sin_kernel[(triton.cdiv(num_positions, block_rows), num_tables)](
        positions.contiguous(), inv_freq.float().contiguous(), cos, sin, num_positions, rope_half,
        BLOCK_R=block_rows, BLOCK_H=block_h, num_warps=1 if block_rows * block_h <= 512 else 4,
        **dependent_launch(positions.device))
    return cos, sin
    block_h = triton.next_power_of_2(rope_half)
    block_rows = min(block_rows, triton.next_power_of_2(num_positions))
    _cos_sin_kernel[(triton.cdiv(num_positions, block_rows),)](
        positions.contiguous(), inv_freq.float().contiguous(), cos, sin, num_positions, rope_half,
        BLOCK_R=block_rows, BLOCK_H=block_h, num_warps=1 if block_rows * block_h <= 512 else 4,
        **dependent_launch(positions.device))
    return cos, sin
