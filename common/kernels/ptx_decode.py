"""Inline-PTX weight decoders for Hopper (sm_90): FP4 e2m1 and FP8 e4m3 straight to bf16x2.

Legend: BN rows (output features) of the tile, BK input features, G = BK/32 scale groups.

Each decoder places the code's bits into a bf16 bit pattern with shifts and masks (prmt spreads
bytes into 16-bit lanes first) and finishes with `mul.bf16x2` by a power of two that carries the
ue8m0 scale, so the bf16 results are exact (bf16 multiplies keep subnormal inputs). They feed
`tl.dot` directly: no fp32 tile, no fp32 -> bf16 conversion. GPU only (the interpreter cannot run
inline assembly); `bench/checks/fp4_decode_probe.py` checks each one bit for bit against `reference.py`.

Measured on an H200 (docs/performance.md): the "quad" decoders, which read the codes as
16/32-bit words and return four tiles by k mod 4, need the fewest instructions per element.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moemesh.common.kernels.dequant_tiles import (
    load_fp4_group_scales, load_fp4_groups, load_fp8_block_scales, load_fp8_codes,
)

# (magnitude shift, sign shift) that place a code's bits in a 16-bit lane (< 0: a right shift): e2m1 nibble r
# of a 16-bit half (bits 4r+2..4r -> 8..6, bit 4r+3 -> 15), so the low / high nibble of a byte are r = 0 / 1;
# e4m3 byte (bits 6..0 -> 10..4, bit 7 -> 15).
_E2M1_NIBBLE_SHIFTS = tuple((6 - 4 * r, 12 - 4 * r) for r in range(4))
(_E2M1_LOW, _E2M1_HIGH), _E4M3_BYTE = _E2M1_NIBBLE_SHIFTS[:2], (4, 8)
_E2M1_MAGNITUDE_MASK, _E4M3_MAGNITUDE_MASK = "0x01C001C0", "0x07F007F0"


def _asm_block(registers: str, lines: list[str]) -> tl.constexpr:
    """One PTX scope declaring `registers` (b32) and running `lines`, one instruction a line."""
    return tl.constexpr("\n{\n" + "".join(f"{line};\n" for line in [f".reg .b32 {registers}", *lines]) + "}\n")


def _placed_outputs(operands: list[tuple[str, tuple[int, int], str]], magnitude_mask: str,
                    bias: bool = False) -> list[str]:
    """Output $i from operands[i] = (code register, (magnitude shift, sign shift), scale register).

    Each output: the codes' magnitude bits and sign placed in both 16-bit lanes of `t` (a shift left by a
    positive count, right by a negative one, none at 0), then (with `bias`) times the register `bias`, then times
    the scale pair."""
    lines = []
    for out, (codes, (magnitude_shift, sign_shift), scale) in enumerate(operands):
        lines += [
            *_shift("t", codes, magnitude_shift), f"and.b32 t, {'t' if magnitude_shift else codes}, {magnitude_mask}",
            *_shift("u", codes, sign_shift), f"and.b32 u, {'u' if sign_shift else codes}, 0x80008000",
            "or.b32 t, t, u",
            *(["mul.bf16x2 t, t, bias"] if bias else []), f"mul.bf16x2 ${out}, t, {scale}",
        ]
    return lines


def _shift(destination: str, source: str, count: int) -> list[str]:
    if count > 0:
        return [f"shl.b32 {destination}, {source}, {count}"]
    return [f"shr.b32 {destination}, {source}, {-count}"] if count < 0 else []


@triton.jit
def _bf16x2_power_pair(s, exponent_offset: tl.constexpr):
    """int32 scale bytes s -> bf16x2 registers holding 2^(s + exponent_offset - 127) in both lanes."""
    return ((s + exponent_offset) << 7) * 65537


# Four packed bytes b0..b3 (and their four scale bytes s0..s3) -> bf16x2 registers:
# $0 = even(b0, b1), $1 = even(b2, b3), $2 = odd(b0, b1), $3 = odd(b2, b3), even = low nibble.
# prmt spreads two bytes into the two 16-bit halves; the nibble's magnitude bits go to bf16 bits
# 8..6 (two low exponent bits + top mantissa bit) and its sign to bit 15, which is exactly
# LUT[code] * 2^-126 (codes 0 and 1 as bf16 subnormals); times 2^126 (bf16 multiplies keep
# subnormals) that is LUT[code], times the scale byte placed in the bf16 exponent, 2^(s - 127).
# Both products are exact for scale bytes 1..254.
_E2M1_BF16_ASM = _asm_block("z, bias, lo, hi, slo, shi, t, u", [
    "mov.b32 z, 0", "mov.b32 bias, 0x7E807E80",
    "prmt.b32 lo, $4, z, 0x4140", "prmt.b32 hi, $4, z, 0x4342",
    "prmt.b32 slo, $5, z, 0x4140", "prmt.b32 shi, $5, z, 0x4342",
    "shl.b32 slo, slo, 7", "shl.b32 shi, shi, 7",
    *_placed_outputs([("lo", _E2M1_LOW, "slo"), ("hi", _E2M1_LOW, "shi"),
                      ("lo", _E2M1_HIGH, "slo"), ("hi", _E2M1_HIGH, "shi")], _E2M1_MAGNITUDE_MASK, bias=True),
])


@triton.jit
def fp4_tile_halves_bf16_asm(
    w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """As `fp4_tile_halves`, bf16 results decoded four bytes per inline-PTX call (sm_90: mul.bf16x2).

    About 4 instructions per element (prmt, shift/and/or placement, two bf16x2 multiplies) and no
    fp32 -> bf16 conversion; GPU only (the interpreter cannot run inline assembly).
    """
    packed = load_fp4_groups(w_ptr, offs_n, mask_n, k_begin, stride_wn, BLOCK_K)  # [BN, G, 16] uint8
    s = load_fp4_group_scales(s_ptr, offs_n, mask_n, k_begin, stride_sn, BLOCK_K).to(tl.uint8, bitcast=True)
    s_full = tl.broadcast_to(s[:, :, None], packed.shape)  # [BN, G, 16]
    even, odd = tl.inline_asm_elementwise(
        _E2M1_BF16_ASM, "=r,=r,=r,=r,r,r", [packed, s_full], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
    )
    return tl.reshape(even, [BLOCK_N, BLOCK_K // 2]), tl.reshape(odd, [BLOCK_N, BLOCK_K // 2])


# As _E2M1_BF16_ASM, but the 2^126 bias is folded into the scale, given per element as a
# ready bf16x2 pair 2^(s - 17) (inputs $5..$8 for elements 0..3): one multiply per pair, no scale
# unpacking. The result is W * 2^-16 (exact for scale bytes 18..144, where every product stays a
# normal bf16); the caller multiplies its fp32 accumulator by 2^16 once after the K loop.
_E2M1_BF16_FOLDED_ASM = _asm_block("z, lo, hi, s01, s23, t, u", [
    "mov.b32 z, 0",
    "prmt.b32 lo, $4, z, 0x4140", "prmt.b32 hi, $4, z, 0x4342",
    "prmt.b32 s01, $5, $6, 0x7610", "prmt.b32 s23, $7, $8, 0x7610",
    *_placed_outputs([("lo", _E2M1_LOW, "s01"), ("hi", _E2M1_LOW, "s23"),
                      ("lo", _E2M1_HIGH, "s01"), ("hi", _E2M1_HIGH, "s23")], _E2M1_MAGNITUDE_MASK),
])
FOLDED_SCALE_SHIFT = tl.constexpr(65536.0)  # 2^16: the factor the folded decode leaves out


@triton.jit
def fp4_tile_halves_bf16_folded_asm(
    w_ptr, s_ptr, offs_n, mask_n, k_begin, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """As `fp4_tile_halves_bf16_asm` with the bias folded into the scale: returns W * 2^-16 halves.

    About 3 instructions per element. Exact for scale bytes 18..144 (real checkpoints: ~110..130).
    """
    packed = load_fp4_groups(w_ptr, offs_n, mask_n, k_begin, stride_wn, BLOCK_K)  # [BN, G, 16] uint8
    pair = fp4_scale_pairs(s_ptr, offs_n, mask_n, k_begin, stride_sn, BLOCK_K)  # [BN, G]
    pair_full = tl.broadcast_to(pair[:, :, None], packed.shape)  # [BN, G, 16]
    even, odd = tl.inline_asm_elementwise(
        _E2M1_BF16_FOLDED_ASM, "=r,=r,=r,=r,r,r,r,r,r", [packed, pair_full], dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=4,
    )
    return tl.reshape(even, [BLOCK_N, BLOCK_K // 2]), tl.reshape(odd, [BLOCK_N, BLOCK_K // 2])


# One 32-bit register = two uint16 elements = 8 codes, k = 4j..4j+3 for each element j; outputs
# $0..$3 = the codes with k % 4 == 0, 1, 2, 3 of both elements (bf16x2, W * 2^-16 as in the folded
# decode); $4 the codes, $5 / $6 the bf16x2 scale pairs 2^(s - 17) of the two elements. Nibble r of
# each 16-bit half is code 4j + r, so the two halves already sit 16 bits apart like the two bf16
# lanes: every output is placed straight from the word, one shift moving both lanes (bits crossing
# the lane boundary fall outside the masks): magnitude bits 4r..4r+2 -> 6..8, sign 4r+3 -> 15.
_E2M1_QUAD_ASM = _asm_block("sc, t, u", [
    "prmt.b32 sc, $5, $6, 0x7610",
    *_placed_outputs([("$4", shifts, "sc") for shifts in _E2M1_NIBBLE_SHIFTS], _E2M1_MAGNITUDE_MASK),
])


@triton.jit
def fp4_scale_pairs(s_ptr, offs_n, mask_n, k_begin, stride_sn, BLOCK_K: tl.constexpr):
    """ue8m0 bytes of the tile as folded bf16x2 pairs 2^(s - 17) [BN, BK/32] int32 (for the quad decode).

    Separate from the decode so that the kernel can load the next K step's scales one step ahead
    (a plain register prefetch: Triton's pipeliner does not stage these byte loads)."""
    s = load_fp4_group_scales(s_ptr, offs_n, mask_n, k_begin, stride_sn, BLOCK_K).to(tl.int32)  # [BN, G]
    return _bf16x2_power_pair(s, 110)


@triton.jit
def fp4_scale_pairs_from_words(s_ptr, offs_n, mask_n, k_begin, stride_sn, BLOCK_K: tl.constexpr):
    """As `fp4_scale_pairs`, reading the scale bytes as 32-bit words (4 groups = 128 k each).

    Word loads are wide enough for Triton's pipeliner to stage them with the weights (cp.async),
    where byte loads are issued in the loop. Needs BLOCK_K a multiple of 128, k_begin a multiple
    of 128 and a row stride (K/32 bytes) that is a multiple of 4."""
    NUM_WORDS: tl.constexpr = BLOCK_K // 128
    s32_ptr = s_ptr.to(tl.pointer_type(tl.uint32))
    offs_w = (k_begin // 128) + tl.arange(0, NUM_WORDS)  # [BK/128]
    words = tl.load(s32_ptr + offs_n[:, None] * (stride_sn // 4) + offs_w[None, :], mask=mask_n[:, None],
                    other=0x7F7F7F7F)  # [BN, BK/128]
    shifts = 8 * tl.arange(0, 4)  # [4] little-endian byte g of a word = group 4w + g
    s = ((words[:, :, None] >> shifts[None, None, :]) & 0xFF).to(tl.int32)  # [BN, BK/128, 4]
    s = tl.reshape(s, [words.shape[0], BLOCK_K // 32])  # [BN, G]
    return _bf16x2_power_pair(s, 110)


@triton.jit
def fp4_tile_quarters_bf16_asm(
    w_ptr, pair, offs_n, mask_n, k_begin, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """FP4 tile as four [BN, BK/4] bf16 tiles q0..q3 (q_r[:, j] = W[:, k_begin + 4j + r] * 2^-16).

    The codes are read as uint16 (4 codes each), so the two uint16 a thread holds side by side in
    a wgmma A fragment come as one 32-bit word straight into the inline PTX, with no byte packing;
    the caller splits x the same four ways and runs four dots. Exact for scale bytes 18..144.
    `stride_wn` is in bytes and must be even (rows of K/2 bytes, K a multiple of 32).
    """
    NUM_GROUPS: tl.constexpr = BLOCK_K // 32
    offs_g = tl.arange(0, NUM_GROUPS)  # [G]
    offs_h = tl.arange(0, 8)  # 8 uint16 = 32 codes per scale group
    half_cols = (k_begin // 4) + offs_g[:, None] * 8 + offs_h[None, :]  # [G, 8]
    w16_ptr = w_ptr.to(tl.pointer_type(tl.uint16))
    codes = tl.load(
        w16_ptr + offs_n[:, None, None] * (stride_wn // 2) + half_cols[None, :, :], mask=mask_n[:, None, None], other=0
    )  # [BN, G, 8] uint16
    pair_full = tl.broadcast_to(pair[:, :, None], [BLOCK_N, NUM_GROUPS, 8])  # [BN, G, 8] from fp4_scale_pairs
    q0, q1, q2, q3 = tl.inline_asm_elementwise(
        _E2M1_QUAD_ASM, "=r,=r,=r,=r,r,r,r", [codes, pair_full],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
    )
    shape: tl.constexpr = [BLOCK_N, BLOCK_K // 4]
    return tl.reshape(q0, shape), tl.reshape(q1, shape), tl.reshape(q2, shape), tl.reshape(q3, shape)


# e4m3 bytes -> bf16x2, four per call ($4), scale pairs per element ($5..$8): the byte's
# exponent+mantissa bits shifted by 4 land in the bf16 exponent's low four bits and the top
# mantissa bits (value 2^-120 times the e4m3 value, e4m3 subnormals as bf16 subnormals), the sign
# moves to bit 15; one multiply by 2^(s - 7) = 2^120 * 2^(s - 127) finishes. Exact for scale bytes
# <= 134 (NaN codes are not handled: checkpoints have none).
_E4M3_BF16_ASM = _asm_block("z, lo, hi, s01, s23, t, u", [
    "mov.b32 z, 0",
    "prmt.b32 lo, $2, z, 0x4140", "prmt.b32 hi, $2, z, 0x4342",
    "prmt.b32 s01, $3, $4, 0x7610", "prmt.b32 s23, $5, $6, 0x7610",
    *_placed_outputs([("lo", _E4M3_BYTE, "s01"), ("hi", _E4M3_BYTE, "s23")], _E4M3_MAGNITUDE_MASK),
])


# Two uint32 words (4 e4m3 codes each, k = 4j..4j+3) -> four bf16x2 registers by k mod 4: $0..$3,
# inputs $4 / $5 the words of elements j and j + 1, $6 / $7 their scale pairs 2^(s - 7). Each byte
# is moved to the high half of a 16-bit lane by prmt (selectors 0x4400, 0x5511, 0x6622, 0x7733 for
# byte 0..3 of both words), so one shift right by 4 places exponent and mantissa and the sign is
# already at bit 15.
_E4M3_QUAD_ASM = _asm_block("sc, t, u", ["prmt.b32 sc, $6, $7, 0x7610"] + [
    line
    for byte in range(4)
    for line in (
        f"prmt.b32 t, $4, $5, 0x{byte + 4}{byte + 4}{byte}{byte}", "shr.b32 u, t, 4",
        f"and.b32 u, u, {_E4M3_MAGNITUDE_MASK}", "and.b32 t, t, 0x80008000", "or.b32 t, t, u",
        f"mul.bf16x2 ${byte}, t, sc",
    )
])


@triton.jit
def fp8_tile_quarters_bf16_asm(w_ptr, s_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, stride_sn,
                               BLOCK_K: tl.constexpr):
    """FP8 tile as four [BN, BK/4] bf16 tiles by k mod 4 (q_r[:, j] = W[:, k_begin + 4j + r]).

    Reads the codes as uint32 (4 per element), so the pair of words a wgmma A fragment holds is one
    8-byte load straight into the PTX. Exact for scale bytes <= 134. GPU only. `stride_wn` and
    `num_cols` must be multiples of 4 (bytes); columns past `num_cols` read 0.
    """
    offs_w = k_begin // 4 + tl.arange(0, BLOCK_K // 4)  # [BK/4] word columns
    w32_ptr = w_ptr.to(tl.pointer_type(tl.uint32))
    words = tl.load(w32_ptr + offs_n[:, None] * (stride_wn // 4) + offs_w[None, :],
                    mask=mask_n[:, None] & (offs_w[None, :] < num_cols // 4), other=0)  # [BN, BK/4]
    s = load_fp8_block_scales(s_ptr, offs_n, mask_n, k_begin, stride_sn)  # [BN]
    pair_full = tl.broadcast_to(_bf16x2_power_pair(s, 120)[:, None], words.shape)  # [BN, BK/4] 2^(s - 7) pairs
    return tl.inline_asm_elementwise(
        _E4M3_QUAD_ASM, "=r,=r,=r,=r,r,r,r,r", [words, pair_full],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
    )


@triton.jit
def fp8_tile_bf16_asm(w_ptr, s_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, stride_sn, BLOCK_K: tl.constexpr):
    """As `fp8_tile`, decoded to bf16 by inline PTX (~3 instructions per element, no fp16/fp32 detour).

    GPU only; exact for scale bytes <= 134 (weights below 2^7 * 448)."""
    w_bytes = load_fp8_codes(w_ptr, offs_n, mask_n, k_begin, num_cols, stride_wn, BLOCK_K)  # [BN, BK]
    s = load_fp8_block_scales(s_ptr, offs_n, mask_n, k_begin, stride_sn)  # [BN]
    pair_full = tl.broadcast_to(_bf16x2_power_pair(s, 120)[:, None], w_bytes.shape)  # [BN, BK] 2^(s - 7) pairs
    return tl.inline_asm_elementwise(
        _E4M3_BF16_ASM, "=r,=r,r,r,r,r,r", [w_bytes.to(tl.uint8, bitcast=True), pair_full], dtype=tl.bfloat16,
        is_pure=True, pack=4,
    )
