"""FP8 quant-dequant simulation of KV rows: the official reference's QAT numerics (docs/model.md §2.3, §2.5, §4.3).

The reference stores every window kv row and every main-compressor row after a quant-dequant round
trip of its first `nope_head_dim` channels (the rotary tail stays in the activation dtype):
per row, per block of 64 consecutive channels,
    amax  = max(max |x|, 1e-4)                      (the floor keeps all-zero blocks finite)
    s     = 2^ceil(log2(amax · fp32(1/448)))        (power-of-two scale, "ue8m0")
    x'    = float(e4m3(clamp(x / s, -448, 448))) · s
The result is cast back to the input dtype. It is exact there for float32 and bfloat16 (an e4m3
value has 4 significant bits, times a power of two), so a stored row is, per block, exactly some
e4m3 value times 2^k. float16 can flush the smallest values of a tiny-amax block to zero (its
exponent range is narrower); the reference never runs fp16.
The CSA indexer's rows (`indexer_fp8_qat`) take the same round trip with one block per row (128 channels in
V4-Flash): the FP8 rounding of the production indexer cache (e4m3 codes, one scale per row).

Choices the model description leaves open:
- The reference asserts that the quantized width is a multiple of the block (448 = 7 · 64). Tiny
  test models have other widths, so a shorter last block is allowed here: its amax and scale come
  from its own channels only. For real models nothing changes.
- The scale is computed as the reference kernel does, amax multiplied by the fp32 constant 1/448,
  then rounded up to a power of two from the float's exponent and mantissa bits (exact, no log2).
- NaN/inf inputs are not treated specially (the reference does not either).
Legend: R rows (any leading dims), C channels, B blocks per row, b block size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moemesh.common.model.kv_layouts import KV_FP8_BLOCK_SIZE

E4M3_MAX = 448.0
ACT_QUANT_AMAX_FLOOR = 1e-4


def pow2_scale_ceil(amax: torch.Tensor, max_value: float = E4M3_MAX) -> torch.Tensor:
    """amax [...] (> 0) -> 2^ceil(log2(amax · fp32(1/max_value))) [...] float32.

    Computed from frexp (ratio = m · 2^e, m in [0.5, 1)): an exact power of two (m = 0.5) keeps its
    exponent, anything else rounds up, as the reference's bit-level `fast_log2_ceil` does."""
    # a fill, not a host tensor's copy: a CUDA graph can capture it
    inverse = torch.full((), 1.0 / max_value, dtype=torch.float32, device=amax.device)
    ratio = amax.float() * inverse  # [...]
    mantissa, exponent = torch.frexp(ratio)
    log2_ceil = torch.where(mantissa == 0.5, exponent - 1, exponent)  # int32
    return torch.ldexp(torch.ones_like(ratio), log2_ceil)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [R, C] -> zero-padded fp32 [R, B, b] (padding never raises a block's amax)."""
    num_channels = x.shape[-1]
    num_blocks = -(-num_channels // block_size)
    padded = F.pad(x.float(), (0, num_blocks * block_size - num_channels))
    return padded.view(*x.shape[:-1], num_blocks, block_size)


def fp8_block_scales(x: torch.Tensor, block_size: int = KV_FP8_BLOCK_SIZE,
                     amax_floor: float = ACT_QUANT_AMAX_FLOOR) -> torch.Tensor:
    """x [R, C] -> per-block power-of-two scales [R, B] float32 (B = ceil(C / block_size))."""
    amax = _blocks(x, block_size).abs().amax(dim=-1).clamp_min(amax_floor)  # [R, B]
    return pow2_scale_ceil(amax)


def fp8_quant_dequant(x: torch.Tensor, block_size: int = KV_FP8_BLOCK_SIZE,
                      amax_floor: float = ACT_QUANT_AMAX_FLOOR) -> torch.Tensor:
    """x [R, C] -> x' [R, C] in x's dtype: the e4m3 round trip of every block (see module doc)."""
    if x.shape[-1] == 0:
        return x.clone()
    blocks = _blocks(x, block_size)  # [R, B, b] fp32
    scales = pow2_scale_ceil(blocks.abs().amax(dim=-1, keepdim=True).clamp_min(amax_floor))  # [R, B, 1]
    codes = (blocks / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # [R, B, b]
    restored = (codes.float() * scales).flatten(-2)[..., : x.shape[-1]]  # [R, C]
    return restored.to(x.dtype)


def kv_nope_fp8_qat(rows: torch.Tensor, nope_dim: int, block_size: int = KV_FP8_BLOCK_SIZE) -> torch.Tensor:
    """rows [R, hd] -> [R, hd]: channels [:nope_dim] quant-dequantized, the rotary tail untouched.

    Applied to window kv rows after kv_norm + RoPE and to compressed rows after norm + RoPE, before
    they are stored or attended to, so the current step and later steps read the same values."""
    if not 0 <= nope_dim <= rows.shape[-1]:
        raise ValueError(f"nope_dim={nope_dim} outside [0, {rows.shape[-1]}]")
    return torch.cat([fp8_quant_dequant(rows[..., :nope_dim], block_size), rows[..., nope_dim:]], dim=-1)


def indexer_fp8_qat(rows: torch.Tensor) -> torch.Tensor:
    """rows [R, d] -> [R, d]: every channel quant-dequantized with one power-of-two scale per row.

    Applied to the CSA indexer's compressed rows after norm and RoPE, before they are stored: the values an FP8
    indexer row (`common.model.kv_rows.IndexerRowLayout`) holds, so FP8 and plain storage score the same keys."""
    return fp8_quant_dequant(rows, block_size=max(1, rows.shape[-1]))
