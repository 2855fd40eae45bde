"""FP8 block and FP4 expert quantization formats (docs/model.md §4.3)."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.checkpoint.quant import (
    E2M1_VALUES,
    dequantize_fp4,
    dequantize_fp8_block,
    fp4_codes_from_values,
    infer_block_size,
    pack_fp4_codes,
    pow2_scale_exponent,
    quantize_fp4,
    quantize_fp8_block,
    unpack_fp4_codes,
)


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8).to(torch.int32)


def test_fp8_scale_is_smallest_power_of_two_covering_block():
    # block amaxes 448 (s=1), 449 (s=2), 0.875 = 448/512 (s=2^-9), 0 (s=1 by convention)
    weight = torch.zeros(256, 256)
    weight[0, 0] = -448.0
    weight[5, 200] = 449.0
    weight[130, 3] = 0.875
    fp8, scale = quantize_fp8_block(weight, (128, 128))
    assert scale.dtype == torch.float8_e8m0fnu and fp8.dtype == torch.float8_e4m3fn
    assert _e8m0_bytes(scale).tolist() == [[127, 128], [127 - 9, 127]]
    assert fp8[0, 0].float().item() == -448.0
    assert fp8[5, 200].float().item() == pytest.approx(224.0)  # 449 / 2 rounds to 224
    assert fp8[130, 3].float().item() == 448.0


def test_pow2_exponent_exact_at_powers_of_two():
    amax = torch.tensor([448.0, 896.0, 448.0 * 0.5, 448.0 * 1.0000001, 1e-30, 1e-40, 0.0])
    got = pow2_scale_exponent(amax, 448.0).tolist()
    assert got[:4] == [0, 1, -1, 1]
    assert got[4] == -108  # ceil(log2(1e-30 / 448)) = ceil(-108.47)
    assert got[5] == -127  # clamped to the smallest e8m0 exponent
    assert got[6] == 0  # all-zero block: scale 1
    assert pow2_scale_exponent(torch.tensor([6.0, 3.0, 7.0]), 6.0).tolist() == [0, -1, 1]


def test_fp8_partial_edge_blocks_round_trip_values():
    torch.manual_seed(0)
    weight = torch.randn(200, 300) * 3
    fp8, scale = quantize_fp8_block(weight, (128, 128))
    assert tuple(scale.shape) == (2, 3)
    values = dequantize_fp8_block(fp8, scale, torch.float32, block_size=(128, 128))
    # e4m3 has 3 mantissa bits: relative error per element at most 2^-4 (plus subnormals)
    scale_full = scale.float().repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.all((values - weight).abs() <= weight.abs() * 2**-4 + scale_full * 2**-9)
    # dequantized values are fixed points: quantizing them again gives the same values
    fp8_again, scale_again = quantize_fp8_block(values, (128, 128))
    values_again = dequantize_fp8_block(fp8_again, scale_again, torch.float32, block_size=(128, 128))
    assert torch.equal(values_again, values)


def test_fp8_quantize_of_dequantize_is_identity_on_codes():
    torch.manual_seed(1)
    # codes whose block maximum exceeds 224 (half of 448): the scale is then reproduced exactly
    codes = (torch.rand(256, 384) * 2 - 1) * 448
    codes[::128, ::128] = 448.0
    fp8 = codes.to(torch.float8_e4m3fn)
    scale = (torch.randint(110, 140, (2, 3), dtype=torch.int32)).to(torch.uint8).view(torch.float8_e8m0fnu)
    weight = dequantize_fp8_block(fp8, scale, torch.float32)
    fp8_again, scale_again = quantize_fp8_block(weight, (128, 128))
    assert torch.equal(scale_again.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(fp8_again.view(torch.uint8), fp8.view(torch.uint8))


def test_fp8_dequantize_known_values_and_bf16():
    fp8 = torch.tensor([[1.5, -2.0], [0.5, 448.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^3
    out = dequantize_fp8_block(fp8, scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [[12.0, -16.0], [4.0, 3584.0]]


def test_block_size_inference_matches_transformers_and_partial():
    assert infer_block_size((256, 384), (2, 3)) == (128, 128)
    assert infer_block_size((200, 300), (2, 3)) == (100, 100)  # divisible: transformers' reading
    assert infer_block_size((200, 301), (2, 3)) == (100, 101)
    with pytest.raises(ValueError, match="scale grid"):
        dequantize_fp8_block(torch.zeros(256, 256).to(torch.float8_e4m3fn), torch.ones(3, 2).to(torch.float8_e8m0fnu),
                             block_size=(128, 128))


def test_fp4_codes_known_values_and_ties_to_even():
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0, -0.0])
    assert fp4_codes_from_values(values).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 15, 8]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])
    assert fp4_codes_from_values(ties).tolist() == [0, 2, 2, 4, 4, 6, 6, 14]
    near = torch.tensor([0.26, 0.74, 2.49, 2.51, 4.99, 5.01, 0.1, -0.1])
    assert fp4_codes_from_values(near).tolist() == [1, 1, 4, 5, 6, 7, 0, 8]


def test_fp4_nibble_order_low_nibble_is_even_column():
    codes = torch.tensor([[1, 7, 15, 8, 0, 3]], dtype=torch.uint8)
    packed = pack_fp4_codes(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x71, 0x8F, 0x30]]
    assert torch.equal(unpack_fp4_codes(packed), codes)
    # one byte, scale 2^0: 0x71 = low 1 (0.5, column 0), high 7 (6.0, column 1)
    scale = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    row = torch.tensor([[0x71] + [0] * 15], dtype=torch.uint8).view(torch.int8)
    assert dequantize_fp4(row, scale)[0, :2].tolist() == [0.5, 6.0]


def test_fp4_quantize_known_block():
    # one 32-wide block, amax 12 -> s = 2^ceil(log2(12/6)) = 2
    weight = torch.zeros(1, 32)
    weight[0, :6] = torch.tensor([12.0, -1.0, 2.6, 0.4, -7.0, 5.0])
    packed, scale = quantize_fp4(weight)
    assert scale.view(torch.uint8).tolist() == [[128]]
    codes = unpack_fp4_codes(packed)[0, :6].tolist()
    # /2 -> 6, -0.5, 1.3, 0.2, -3.5, 2.5 -> codes 7, 9, 3 (1.5), 0, 14 (-4, tie to even), 4 (2, tie)
    assert codes == [7, 9, 3, 0, 14, 4]
    assert dequantize_fp4(packed, scale)[0, :6].tolist() == [12.0, -1.0, 3.0, 0.0, -8.0, 4.0]


def test_fp4_quantize_of_dequantize_is_identity_on_codes():
    torch.manual_seed(2)
    num_rows, num_cols = 64, 256
    codes = torch.randint(0, 16, (num_rows, num_cols), dtype=torch.uint8)
    codes[:, ::32] = 7  # every block holds +6, so its scale is reproduced exactly
    packed = pack_fp4_codes(codes)
    scale = torch.randint(100, 150, (num_rows, num_cols // 32), dtype=torch.int32).to(torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)
    weight = dequantize_fp4(packed, scale, torch.float32)
    packed_again, scale_again = quantize_fp4(weight)
    assert torch.equal(scale_again.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(packed_again.view(torch.uint8), packed.view(torch.uint8))


def test_fp4_values_are_fixed_points_and_bf16_output():
    torch.manual_seed(3)
    weight = torch.randn(32, 128)
    packed, scale = quantize_fp4(weight)
    values = dequantize_fp4(packed, scale, torch.float32)
    lut = torch.tensor(E2M1_VALUES)
    assert torch.all((values / scale.float().repeat_interleave(32, 1)).unsqueeze(-1).eq(lut).any(-1))
    assert torch.equal(dequantize_fp4(*quantize_fp4(values), torch.float32), values)
    assert torch.equal(dequantize_fp4(packed, scale, torch.bfloat16), values.to(torch.bfloat16))
    # nearest representable: error at most half the widest gap (2 of 4..6) times the scale
    assert torch.all((values - weight).abs() <= scale.float().repeat_interleave(32, 1) * 1.0)
