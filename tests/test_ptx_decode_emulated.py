"""The inline-PTX weight decoders (common/kernels/ptx_decode.py) run on the CPU through a PTX emulator
(`ptx_subset.py`) against `reference.py`, bit for bit: every FP4 word / every FP8 code, several scales.

On the GPU the same decoders are checked by `bench/checks/fp4_decode_probe.py` and the kernel tests; here a bit
placement that is wrong for some code fails without one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ptx_subset import _prmt, bf16_bits_to_float, float_to_bf16_bits, run_block  # noqa: E402

from moemesh.common.kernels import ptx_decode  # noqa: E402
from moemesh.common.kernels.reference import E2M1_MAGNITUDES, fp8_weight_to_float  # noqa: E402


def _asm(block) -> str:
    return block.value if hasattr(block, "value") else str(block)


def _pair(scale_byte: int, exponent_offset: int) -> np.ndarray:
    """`ptx_decode._bf16x2_power_pair` of one scale byte, as a uint32."""
    return np.uint32(((scale_byte + exponent_offset) << 7) * 65537)


def _e2m1(codes: np.ndarray) -> np.ndarray:
    """float64 value of 4-bit codes."""
    magnitudes = np.asarray(E2M1_MAGNITUDES)[codes & 7]
    return np.where(codes & 8, -magnitudes, magnitudes)


def _lanes(register: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return register & np.uint32(0xFFFF), register >> np.uint32(16)


def _expect_bits(values: np.ndarray) -> np.ndarray:
    bits = float_to_bf16_bits(values)
    assert np.array_equal(bf16_bits_to_float(bits), values), "expected values must be exact in bf16"
    return bits


def test_emulated_prmt_follows_the_byte_selectors():
    a, b = np.array([0x44332211], dtype=np.uint32), np.array([0x88776655], dtype=np.uint32)
    assert _prmt(a, b, np.array([0x7610], dtype=np.uint32))[0] == 0x88772211  # low half of a, high half of b
    assert _prmt(a, b, np.array([0x3210], dtype=np.uint32))[0] == 0x44332211
    assert _prmt(a, b, np.array([0x7654], dtype=np.uint32))[0] == 0x88776655
    assert _prmt(a, b, np.array([0x4240], dtype=np.uint32))[0] == 0x55335511
    assert _prmt(a, b, np.array([0x000F], dtype=np.uint32))[0] == 0x111111FF  # byte 7 = 0x88: sign replicated


@pytest.mark.parametrize("scales", [(18, 18), (127, 127), (144, 144), (100, 131)])
def test_fp4_quad_decode_places_every_word_exactly(scales):
    low = np.arange(1 << 16, dtype=np.uint32)  # every element j
    high = (low * np.uint32(40503)) & np.uint32(0xFFFF)  # a permutation of them as element j + 1
    words = low | (high << np.uint32(16))
    pairs = {5: np.full(words.shape, _pair(scales[0], 110)), 6: np.full(words.shape, _pair(scales[1], 110))}
    outputs = run_block(_asm(ptx_decode._E2M1_QUAD_ASM), {4: words, **pairs}, 4)
    for r, out in enumerate(outputs):  # k % 4 == r; value W * 2^-16
        got_low, got_high = _lanes(out)
        for got, element, scale in ((got_low, low, scales[0]), (got_high, high, scales[1])):
            want = _e2m1((element >> np.uint32(4 * r)) & np.uint32(0xF)) * 2.0 ** (scale - 127 - 16)
            assert np.array_equal(got, _expect_bits(want)), (r, scale)


@pytest.mark.parametrize("scale", [18, 127, 144])
def test_fp4_folded_halves_decode_every_byte_exactly(scale):
    packed = np.arange(1 << 16, dtype=np.uint32)  # bytes b0, b1 every value; b2, b3 a permutation of them
    words = packed | (((packed * np.uint32(40503)) & np.uint32(0xFFFF)) << np.uint32(16))
    pairs = {5 + i: np.full(words.shape, _pair(scale, 110)) for i in range(4)}
    even01, even23, odd01, odd23 = run_block(_asm(ptx_decode._E2M1_BF16_FOLDED_ASM), {4: words, **pairs}, 4)
    for register, first_byte, nibble in ((even01, 0, 0), (even23, 2, 0), (odd01, 0, 1), (odd23, 2, 1)):
        for lane, got in enumerate(_lanes(register)):
            byte = (words >> np.uint32(8 * (first_byte + lane))) & np.uint32(0xFF)
            want = _e2m1((byte >> np.uint32(4 * nibble)) & np.uint32(0xF)) * 2.0 ** (scale - 127 - 16)
            assert np.array_equal(got, _expect_bits(want)), (first_byte, lane, nibble)


def _e4m3_values(codes: np.ndarray) -> np.ndarray:
    as_bytes = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn)
    return fp8_weight_to_float(as_bytes).double().numpy()


@pytest.mark.parametrize("scales", [(127, 127), (100, 134)])
def test_fp8_quad_decode_places_every_code_exactly(scales):
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint32)  # no NaN codes
    words = [codes | (np.roll(codes, i) << np.uint32(8)) | (np.roll(codes, 2 * i) << np.uint32(16))
             | (np.roll(codes, 3 * i) << np.uint32(24)) for i in (1, 5)]  # elements j and j + 1
    pairs = {6: np.full(codes.shape, _pair(scales[0], 120)), 7: np.full(codes.shape, _pair(scales[1], 120))}
    outputs = run_block(_asm(ptx_decode._E4M3_QUAD_ASM), {4: words[0], 5: words[1], **pairs}, 4)
    for r, out in enumerate(outputs):
        for got, word, scale in zip(_lanes(out), words, scales):
            want = _e4m3_values((word >> np.uint32(8 * r)) & np.uint32(0xFF)) * 2.0 ** (scale - 127)
            assert np.array_equal(got, _expect_bits(want)), (r, scale)


@pytest.mark.parametrize("scales", [(1, 1, 1, 1), (127, 127, 127, 127), (60, 127, 200, 9)])
def test_fp4_halves_decode_every_byte_exactly(scales):
    packed = np.arange(1 << 16, dtype=np.uint32)
    words = packed | (((packed * np.uint32(40503)) & np.uint32(0xFFFF)) << np.uint32(16))
    scale_word = np.full(words.shape, sum(s << (8 * i) for i, s in enumerate(scales)), dtype=np.uint32)
    even01, even23, odd01, odd23 = run_block(_asm(ptx_decode._E2M1_BF16_ASM), {4: words, 5: scale_word}, 4)
    for register, first_byte, nibble in ((even01, 0, 0), (even23, 2, 0), (odd01, 0, 1), (odd23, 2, 1)):
        for lane, got in enumerate(_lanes(register)):
            byte = (words >> np.uint32(8 * (first_byte + lane))) & np.uint32(0xFF)
            scale = scales[first_byte + lane]
            want = _e2m1((byte >> np.uint32(4 * nibble)) & np.uint32(0xF)) * 2.0 ** (scale - 127)
            assert np.array_equal(got, _expect_bits(want)), (first_byte, lane, nibble, scale)
