"""Weight quantization formats of the DeepSeek-V4 hub checkpoint (docs/model.md §4.3).

Two formats, both with power-of-two ue8m0 scales (`torch.float8_e8m0fnu`, value 2^(byte - 127)):

- FP8 block: `weight` float8_e4m3fn [O, I] and `scale` [ceil(O/bo), ceil(I/bi)], one scale per
  bo x bi block (128 x 128 in the checkpoint). Edge blocks may be partial.
  `W[r, c] = fp8[r, c] * scale[r // bo, c // bi]`.
- FP4 experts (MXFP4-compatible): `weight` int8 [O, I/2] holding two e2m1 codes per byte, the
  **low nibble is the even column 2j, the high nibble the odd column 2j+1**; `scale` [O, I/32],
  one per 32 consecutive input elements. `W[r, k] = E2M1[code] * scale[r, k // 32]`.

Quantization picks the smallest power-of-two scale that keeps the block in range:
`s = 2^ceil(log2(amax / max_code))` (448 for e4m3, 6 for e2m1), so a dequantized block is
re-quantized to the same scale whenever its largest code is above half the format maximum.

Everything here is torch only, vectorised, and runs on CPU (and on any device torch supports).
Dequantization multiplies in float32 and casts last, as transformers' `Fp8Dequantize` does, so
both produce bit-identical bf16/fp32 weights.
"""

from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
FP4_BLOCK_SIZE = 32
E8M0_BIAS = 127
# e8m0 byte 255 is NaN, so usable exponents are -127..127.
MIN_SCALE_EXPONENT = -127
MAX_SCALE_EXPONENT = 127

# e2m1 code -> value; codes 8..15 are the negatives of 0..7 (8 is -0).
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)
# Midpoints between consecutive e2m1 magnitudes (codes i and i+1).
_E2M1_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pow2_scale_exponent(amax: torch.Tensor, max_code: float) -> torch.Tensor:
    """Integer exponent k = ceil(log2(amax / max_code)), clamped to the e8m0 range.

    Computed in float64 with `frexp`, which is exact for float32 `amax` (no log2 rounding at
    powers of two). An all-zero block (amax 0) gets exponent 0 (scale 1).
    """
    ratio = amax.double() / max_code
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    ceil_log2 = torch.where(ratio > 0, ceil_log2, torch.zeros_like(ceil_log2))
    return ceil_log2.clamp(MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT).to(torch.int32)


def exponent_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents -> `float8_e8m0fnu` scales (byte = exponent + 127)."""
    return (exponent + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (`float8_e8m0fnu`, or raw uint8 bytes) -> float32 multipliers."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - E8M0_BIAS).exp2()
    return scale.to(torch.float32)


def _blocks_per_dim(size: int, block: int) -> int:
    return -(-size // block)


def quantize_fp8_block(
    weight: torch.Tensor, block_size: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float matrix to FP8 e4m3 with one ue8m0 scale per block.

    Returns `(fp8 [O, I] float8_e4m3fn, scale [ceil(O/bo), ceil(I/bi)] float8_e8m0fnu)`.
    Partial edge blocks are padded with zeros for the amax only.
    """
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    block_rows, block_cols = block_size
    num_rows, num_cols = weight.shape
    grid_rows, grid_cols = _blocks_per_dim(num_rows, block_rows), _blocks_per_dim(num_cols, block_cols)
    # O output rows, I input columns; Gr x Gc blocks of bo x bi after zero padding
    w32 = weight.to(torch.float32)
    padded = torch.zeros(grid_rows * block_rows, grid_cols * block_cols, dtype=torch.float32, device=w32.device)
    padded[:num_rows, :num_cols] = w32
    blocks = padded.view(grid_rows, block_rows, grid_cols, block_cols)  # [Gr, bo, Gc, bi]
    amax = blocks.abs().amax(dim=(1, 3))  # [Gr, Gc]
    exponent = pow2_scale_exponent(amax, FP8_E4M3_MAX)  # [Gr, Gc]
    scale_f32 = torch.ldexp(torch.ones_like(amax), exponent)  # [Gr, Gc]
    scaled = blocks / scale_f32[:, None, :, None]  # [Gr, bo, Gc, bi]
    scaled = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    fp8 = scaled.reshape(grid_rows * block_rows, grid_cols * block_cols)[:num_rows, :num_cols]
    return fp8.contiguous().to(torch.float8_e4m3fn), exponent_to_e8m0(exponent)


def infer_block_size(shape: tuple[int, int], scale_shape: tuple[int, int]) -> tuple[int, int]:
    """Block size from the scale grid: `ceil(rows / grid_rows)` per dimension.

    Where the grid divides the shape this equals transformers' inference (`rows // grid_rows`);
    where it does not, the last block is taken as partial. Note the ambiguity the model description warns
    about (docs/model.md §7.2): 192 rows with a 2-row grid read as 96-row blocks, so pass the real block size
    when it is known.
    """
    return (
        _blocks_per_dim(shape[0], scale_shape[0]),
        _blocks_per_dim(shape[1], scale_shape[1]),
    )


def dequantize_fp8_block(
    fp8: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """FP8 e4m3 weight [O, I] times its block scales -> float tensor [O, I] of `dtype`.

    `block_size=None` infers it from the scale grid (see `infer_block_size`).
    """
    num_rows, num_cols = fp8.shape
    if scale.dim() != 2:
        raise ValueError(f"FP8 scale must be 2-D, got shape {tuple(scale.shape)}")
    if block_size is None:
        block_size = infer_block_size((num_rows, num_cols), tuple(scale.shape))
    block_rows, block_cols = block_size
    expected_grid = (_blocks_per_dim(num_rows, block_rows), _blocks_per_dim(num_cols, block_cols))
    if tuple(scale.shape) != expected_grid:
        raise ValueError(
            f"FP8 scale grid {tuple(scale.shape)} does not match weight {(num_rows, num_cols)} "
            f"with blocks {block_size} (expected {expected_grid})"
        )
    # O rows, I cols; the [Gr, Gc] scale grid is expanded to [O, I]
    scale_f32 = e8m0_to_float(scale)
    scale_full = scale_f32.repeat_interleave(block_rows, dim=0)[:num_rows]
    scale_full = scale_full.repeat_interleave(block_cols, dim=1)[:, :num_cols]  # [O, I]
    return (fp8.to(torch.float32) * scale_full).to(dtype)


def fp4_codes_from_values(values: torch.Tensor) -> torch.Tensor:
    """Round floats already scaled into [-6, 6] to the nearest e2m1 code (uint8 0..15).

    Ties go to the even code (round-half-to-even on the mantissa bit, as hardware converts):
    0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. The sign bit
    is kept for values that round to zero (code 8 is -0), so codes survive a dequantize /
    quantize round trip.
    """
    magnitude = values.abs().to(torch.float32).contiguous()
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=values.device)
    # below: number of midpoints < |x|; at_or_below: number <= |x|. They differ only on a tie at
    # midpoint i (between codes i and i+1), which goes up when i is odd (code i+1 is then even).
    below = torch.bucketize(magnitude, midpoints, right=False)
    at_or_below = torch.bucketize(magnitude, midpoints, right=True)
    tie_up = (at_or_below != below) & (below % 2 == 1)
    code = torch.where(tie_up, at_or_below, below).to(torch.uint8)
    sign = torch.signbit(values).to(torch.uint8) << 3
    return code | sign


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., I] -> int8 bytes [..., I/2]; low nibble = even column, high = odd."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    packed = (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)
    return packed.view(torch.int8)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """int8 (or uint8) bytes [..., I/2] -> uint8 codes [..., I] (low nibble first)."""
    as_bytes = packed.contiguous().view(torch.uint8)
    low = as_bytes & 0xF
    high = (as_bytes >> 4) & 0xF
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def quantize_fp4(
    weight: torch.Tensor, block_size: int = FP4_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float matrix [O, I] to packed e2m1 with one ue8m0 scale per `block_size` inputs.

    Returns `(packed int8 [O, I/2], scale float8_e8m0fnu [O, I/block_size])`.
    """
    if weight.dim() != 2:
        raise ValueError(f"FP4 quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    num_rows, num_cols = weight.shape
    if num_cols % block_size or num_cols % 2:
        raise ValueError(f"FP4 input dim {num_cols} must be a multiple of {block_size} (and of 2)")
    num_blocks = num_cols // block_size
    # O rows, NB blocks of b inputs
    blocks = weight.to(torch.float32).reshape(num_rows, num_blocks, block_size)  # [O, NB, b]
    amax = blocks.abs().amax(dim=-1)  # [O, NB]
    exponent = pow2_scale_exponent(amax, FP4_E2M1_MAX)  # [O, NB]
    scale_f32 = torch.ldexp(torch.ones_like(amax), exponent)  # [O, NB]
    codes = fp4_codes_from_values(blocks / scale_f32.unsqueeze(-1))  # [O, NB, b]
    packed = pack_fp4_codes(codes.reshape(num_rows, num_cols))  # [O, I/2]
    return packed, exponent_to_e8m0(exponent)


def dequantize_fp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed e2m1 [O, I/2] and ue8m0 scales [O, I/b] -> float tensor [O, I] of `dtype`.

    The block size along the input is inferred from the scale grid (`I / scale_cols`).
    """
    num_rows, num_cols = packed.shape[0], 2 * packed.shape[1]
    if scale.dim() != 2 or scale.shape[0] != num_rows or num_cols % scale.shape[1]:
        raise ValueError(
            f"FP4 scale shape {tuple(scale.shape)} does not fit packed weight {tuple(packed.shape)}"
        )
    block_size = num_cols // scale.shape[1]
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = lut[unpack_fp4_codes(packed).long()]  # [O, I]
    scale_full = e8m0_to_float(scale).repeat_interleave(block_size, dim=1)  # [O, I]
    return (values * scale_full).to(dtype)


def fp4_bytes_per_param(block_size: int = FP4_BLOCK_SIZE) -> float:
    """Bytes per parameter of FP4 storage with its scales (0.53125 for blocks of 32)."""
    return 0.5 + 1.0 / block_size


def fp8_bytes(shape: tuple[int, int], block_size: tuple[int, int]) -> int:
    """Bytes of an FP8 weight plus its scale grid."""
    return shape[0] * shape[1] + math.ceil(shape[0] / block_size[0]) * math.ceil(shape[1] / block_size[1])
