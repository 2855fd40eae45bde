"""Triton device functions that load one weight tile and dequantise it to fp32 in registers.

Legend: BN rows (output features) of the tile, BK input features (the dot's K side), G = BK/32.

`fp4_tile` and `fp8_tile` return the fp32 tile [BN, BK] with the ue8m0 scale already applied;
callers cast it to the activation dtype for `tl.dot`. `fp4_tile_halves` returns the even-k and
odd-k columns as two [BN, BK/2] tiles (no interleaving join: the caller splits x the same way and
runs two dots), `fp4_packed_tile` the raw bytes and scale bytes for `tl.dot_scaled`. These run
everywhere, the interpreter included; the faster inline-PTX decoders are in `ptx_decode.py`. The e2m1 and e4m3 values times a power of two are exact
in fp32 and in bf16 (same exponent range), so the cast loses nothing.
The `load_*` functions read a tile's codes and scale bytes; the inline-PTX decoders use them too.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_fp4_groups(w_ptr, offs_n, mask_n, k_begin, stride_wn, BLOCK_K: tl.constexpr):
    """Packed e2m1 bytes of the tile by scale group: [BN, G, 16] uint8 (16 bytes = 32 codes a group).

    Byte column j of group g holds k = k_begin + 32g + 2j (low nibble) and the next k (high nibble).
    Rows past `mask_n` read code 0. `k_begin` must be a multiple of 32.
    """
    offs_g = tl.arange(0, BLOCK_K // 32)  # [G]
    offs_b = tl.arange(0, 16)  # 16 bytes = 32 codes per scale group
    byte_cols = (k_begin // 2) + offs_g[:, None] * 16 + offs_b[None, :]  # [G, 16]
    return tl.load(
        w_ptr + offs_n[:, None, None] * stride_wn + byte_cols[None, :, :], mask=mask_n[:, None, None], other=0
    ).to(tl.uint8, bitcast=True)  # [BN, G, 16]


@triton.jit
def load_fp4_group_scales(s_ptr, offs_n, mask_n, k_begin, stride_sn, BLOCK_K: tl.constexpr):
    """ue8m0 bytes of the tile, one per 32 k: [BN, G] in the scale tensor's dtype (rows past `mask_n` read 127)."""
    offs_g = tl.arange(0, BLOCK_K // 32)  # [G]
    return tl.load(s_ptr + offs_n[:, None] * stride_sn + (k_begin // 32) + offs_g[None, :], mask=mask_n[:, None],
                   other=127)


@triton.jit
def load_fp8_codes(w_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, BLOCK_K: tl.constexpr):
    """e4m3 bytes of the tile [BN, BK] in the weight tensor's dtype; columns past `num_cols` read 0."""
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    return tl.load(
        w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
        mask=mask_n[:, None] & (offs_k[None, :] < num_cols),
        other=0,
    )  # [BN, BK]


@triton.jit
def load_fp8_block_scales(s_ptr, offs_n, mask_n, k_begin, stride_sn):
    """ue8m0 byte of each row's 128 x 128 block at k_begin: [BN] int32 (rows past `mask_n` read 127)."""
    return tl.load(s_ptr + (offs_n // 128) * stride_sn + k_begin // 128, mask=mask_n, other=127).to(tl.int32)


@triton.jit
def fp4_tile(
    w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """FP4 e2m1 packed [N, K/2] (low nibble = even k) with ue8m0 [N, K/32]: tile at rows offs_n, k_begin.

    Decode in ~6 operations per element: the nibble's three magnitude bits (e1 e0 m) placed at
    bits 24..22 of an fp32 (its two lowest exponent bits and top mantissa bit), with the sign at
    bit 31, give exactly LUT[code] * 2^-126 for every code, the zero-exponent codes (0, 0.5)
    landing on fp32 subnormals. Multiplied by 2^(s - 127 + 126) (exact: fp32 multiplies keep
    subnormal inputs; Triton's FTZ flag only affects libdevice calls), that is
    LUT[code] * 2^(s - 127). Exact for scale bytes 0..191 (real checkpoints use ~110..130). `k_begin` must be a multiple of 32.
    """
    low, high = _fp4_nibbles_fp32(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_K)
    return tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K])  # [BN, BK]


@triton.jit
def fp4_tile_halves(
    w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """As `fp4_tile`, but returns (even-k [BN, BK/2], odd-k [BN, BK/2]) without joining them.

    Column j of each half is k = k_begin + 2j (+1): exactly the byte column j, so the [BN, G, 16]
    decode merges its two minor dims into [BN, BK/2] in order, with no element moving between
    threads; the interleaving join of `fp4_tile` is what this avoids.
    """
    low, high = _fp4_nibbles_fp32(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_K)
    return tl.reshape(low, [BLOCK_N, BLOCK_K // 2]), tl.reshape(high, [BLOCK_N, BLOCK_K // 2])


@triton.jit
def _fp4_nibbles_fp32(w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_K: tl.constexpr):
    """The tile's low and high nibbles decoded and scaled: (even k [BN, G, 16], odd k [BN, G, 16]) fp32."""
    packed = load_fp4_groups(w_ptr, offs_n, mask_n, k_begin, stride_wn, BLOCK_K).to(tl.int32)  # [BN, G, 16]
    s = load_fp4_group_scales(s_ptr, offs_n, mask_n, k_begin, stride_sn, BLOCK_K)  # [BN, G]
    # 2^(s - 1) = 2^63 * 2^(s - 64): two exact factors, each a normal fp32 for every byte 0..191.
    factor = ((s.to(tl.int32) + 63) << 23).to(tl.float32, bitcast=True)[:, :, None]  # [BN, G, 1]
    low = (_e2m1_times_2_pow_minus_126(packed) * 9.223372036854775808e18) * factor  # [BN, G, 16] even k
    high = (_e2m1_times_2_pow_minus_126(packed >> 4) * 9.223372036854775808e18) * factor  # [BN, G, 16] odd k
    return low, high


@triton.jit
def fp4_packed_tile(
    w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_K: tl.constexpr
):
    """Raw e2m1 bytes [BN, BK/2] (low nibble = even k) and ue8m0 bytes [BN, BK/32]: the operands of
    `tl.dot_scaled(..., "e2m1", ...)`, whose packing and scale convention (2^(byte - 127) per 32
    k along a row) are the checkpoint's. Rows past `mask_n` read code 0 with scale 2^0."""
    byte_cols = (k_begin // 2) + tl.arange(0, BLOCK_K // 2)  # [BK/2]
    packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + byte_cols[None, :], mask=mask_n[:, None], other=0)
    scale_cols = (k_begin // 32) + tl.arange(0, BLOCK_K // 32)  # [G]
    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + scale_cols[None, :], mask=mask_n[:, None], other=127)
    return packed.to(tl.uint8, bitcast=True), s.to(tl.uint8, bitcast=True)


@triton.jit
def _e2m1_times_2_pow_minus_126(code):
    """int32 code in the low 4 bits (higher bits ignored) -> fp32 LUT[code] * 2^-126."""
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_tile(w_ptr, s_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, stride_sn, BLOCK_K: tl.constexpr):
    """FP8 e4m3 [N, K] with ue8m0 [ceil(N/128), ceil(K/128)]: tile at rows offs_n, k_begin.

    BLOCK_K must divide 128 and k_begin be a multiple of BLOCK_K, so the tile spans one scale column.
    """
    w_bytes = load_fp8_codes(w_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, BLOCK_K)  # [BN, BK]
    s = load_fp8_block_scales(s_ptr, offs_n, mask_n, k_begin, stride_sn)  # [BN]
    scale = (s << 23).to(tl.float32, bitcast=True)  # [BN] 2^(s - 127)
    return w_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
