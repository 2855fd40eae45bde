"""Slow, obviously-correct torch references for the quantized-weight kernels.

Formats (docs/model.md §4.3):
- FP8: weight `float8_e4m3fn` [N, K]; scale ue8m0 [ceil(N/128), ceil(K/128)], one per 128x128 block;
  `W[n, k] = fp8(W[n, k]) * 2^(S[n // 128, k // 128] - 127)`. The scale is a multiplier.
- FP4: weight int8/uint8 [N, K/2], two e2m1 codes per byte packed along K, low nibble = even
  column 2j, high nibble = odd column 2j+1; scale ue8m0 [N, K/32];
  `W[n, k] = LUT[nibble] * 2^(S[n, k // 32] - 127)`, LUT codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6 and
  codes 8..15 their negatives.

Scales may be given as `torch.float8_e8m0fnu` or as their raw bytes (uint8); both are read as
bytes here, so the references never depend on torch's e8m0 conversion. Everything is computed in
fp32 (the LUT and power-of-two scales are exact there), element by element, without tricks: these
functions are the definition the kernels are tested against, not fast code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8_BLOCK_SIZE = 128
FP4_BLOCK_SIZE = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
UE8M0_BIAS = 127


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The raw ue8m0 bytes of a scale tensor, as uint8 (accepts uint8, int8 or float8_e8m0fnu)."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype in (torch.int8, torch.float8_e8m0fnu):
        return scale.view(torch.uint8)
    raise TypeError(f"ue8m0 scales must be uint8, int8 or float8_e8m0fnu, got {scale.dtype}")


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) in fp32; byte 255 is NaN as in float8_e8m0fnu. Exact for every byte."""
    exponent = scale_bytes(scale).to(torch.int32) - UE8M0_BIAS
    value = torch.ldexp(torch.ones_like(exponent, dtype=torch.float64), exponent)
    value = torch.where(scale_bytes(scale) == 255, torch.full_like(value, float("nan")), value)
    return value.to(torch.float32)


def e2m1_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 e2m1 code values in fp32, indexed by the 4-bit code (bit 3 is the sign)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def fp8_weight_to_float(weight: torch.Tensor) -> torch.Tensor:
    """e4m3 codes to fp32; accepts float8_e4m3fn or its uint8/int8 bytes."""
    if weight.dtype in (torch.uint8, torch.int8):
        weight = weight.view(torch.float8_e4m3fn)
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weights must be float8_e4m3fn (or its bytes), got {weight.dtype}")
    return weight.to(torch.float32)


def dequant_fp8_blockwise(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 [N, K] + ue8m0 [ceil(N/128), ceil(K/128)] -> fp32 [N, K]."""
    num_rows, num_cols = weight.shape
    expected = (-(-num_rows // FP8_BLOCK_SIZE), -(-num_cols // FP8_BLOCK_SIZE))
    if tuple(scale.shape) != expected:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} != {expected} for weight {tuple(weight.shape)}")
    factors = ue8m0_to_float(scale)
    factors = factors.repeat_interleave(FP8_BLOCK_SIZE, 0).repeat_interleave(FP8_BLOCK_SIZE, 1)
    return fp8_weight_to_float(weight) * factors[:num_rows, :num_cols]


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] int64 codes; low nibble = even column, high nibble = odd."""
    as_bytes = packed.view(torch.uint8).to(torch.int64)
    low = as_bytes & 0xF
    high = as_bytes >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP4 packed [..., N, K/2] + ue8m0 [..., N, K/32] -> fp32 [..., N, K]."""
    codes = unpack_fp4_codes(packed)
    num_cols = codes.shape[-1]
    if scale.shape[-1] * FP4_BLOCK_SIZE != num_cols or scale.shape[:-1] != codes.shape[:-1]:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)}")
    values = e2m1_lut(packed.device)[codes]
    factors = ue8m0_to_float(scale).repeat_interleave(FP4_BLOCK_SIZE, -1)
    return values * factors


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(W [N, K])^T in fp32 -> fp32 [..., N]."""
    return x.to(torch.float32) @ dequant_fp8_blockwise(weight, scale).T


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (docs/model.md §2.9); no clamp if limit is None."""
    gate = gate.to(torch.float32)
    up = up.to(torch.float32)
    if swiglu_limit is not None:
        gate = torch.clamp(gate, max=swiglu_limit)
        up = torch.clamp(up, min=-swiglu_limit, max=swiglu_limit)
    return torch.nn.functional.silu(gate) * up


def grouped_experts_reference(
    x_sorted: torch.Tensor,
    expert_offsets: torch.Tensor,
    dequantize_expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    swiglu_limit: float | None,
    row_weights: torch.Tensor | None = None,
    intermediate_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-expert SwiGLU over rows sorted by expert, expert by expert, in fp32.

    `dequantize_expert(e) = (w1 [I, D], w3 [I, D], w2 [D, I])` in fp32, called only for experts
    that have rows (a layer's 256 experts in fp32 would take 25 GB); rows
    `expert_offsets[e] : expert_offsets[e + 1]` of `x_sorted` [R, D] belong to expert e. The SwiGLU
    output is rounded to `intermediate_dtype` before the down projection, as a kernel that stores
    it in that dtype does. `row_weights` [R] multiplies each output row (the routing weight).
    Returns fp32 [R, D].
    """
    offsets = [int(v) for v in expert_offsets.tolist()]
    out = None
    for expert_id in range(len(offsets) - 1):
        begin, end = offsets[expert_id], offsets[expert_id + 1]
        if begin == end:
            continue
        w1, w3, w2 = dequantize_expert(expert_id)
        if out is None:
            out = torch.zeros(x_sorted.shape[0], w2.shape[0], dtype=torch.float32, device=x_sorted.device)
        x_rows = x_sorted[begin:end].to(torch.float32)  # [r, D]
        hidden = swiglu_reference(x_rows @ w1.T, x_rows @ w3.T, swiglu_limit)  # [r, I]
        hidden = hidden.to(intermediate_dtype).to(torch.float32)
        out[begin:end] = hidden @ w2.T
    if out is None:
        raise ValueError("no expert has rows")
    if row_weights is not None:
        out = out * row_weights.to(torch.float32)[:, None]
    return out
