"""The slow references the kernels are tested against, checked by hand-made cases (CPU, no triton)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from moemesh.common.kernels import reference
from moemesh.common.kernels.moe_layout import combine_rows, sort_by_expert


def test_e2m1_codes_and_nibble_order():
    # byte 0x21: low nibble 1 (0.5) is column 0, high nibble 2 (1.0) is column 1;
    # byte 0xF8: low nibble 8 (-0), high nibble 15 (-6).
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)
    scale = torch.tensor([[127]], dtype=torch.uint8)
    packed32 = torch.cat([packed, torch.zeros(1, 14, dtype=torch.uint8)], dim=1)  # K = 32
    values = reference.dequant_fp4(packed32, scale)
    assert values[0, :4].tolist() == [0.5, 1.0, -0.0, -6.0]
    assert torch.signbit(values[0, 2])
    lut = reference.e2m1_lut()
    assert lut[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert lut[8:].tolist() == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_fp4_scale_applies_per_32_columns_and_int8_input():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)  # every code 2 -> 1.0, K = 64
    scale = torch.tensor([[127, 130], [120, 127]], dtype=torch.uint8)
    values = reference.dequant_fp4(packed.view(torch.int8), scale)
    assert values[0, :32].eq(1.0).all() and values[0, 32:].eq(8.0).all()
    assert values[1, :32].eq(2.0**-7).all() and values[1, 32:].eq(1.0).all()


def test_ue8m0_matches_torch_e8m0_dtype():
    raw = torch.arange(0, 255, dtype=torch.uint8)
    ours = reference.ue8m0_to_float(raw)
    assert ours[127] == 1.0 and ours[128] == 2.0 and ours[0] == 2.0**-127
    torchs = raw.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(ours, torchs)
    assert torch.isnan(reference.ue8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()


def test_fp8_blockwise_scales_each_128_block_and_ragged_edges():
    weight = torch.ones(130, 260).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 128, 129], [126, 127, 131]], dtype=torch.uint8)
    values = reference.dequant_fp8_blockwise(weight, scale.view(torch.float8_e8m0fnu))
    assert values[0, 0] == 1 and values[127, 128] == 2 and values[0, 259] == 4
    assert values[128, 0] == 0.5 and values[129, 200] == 1 and values[129, 256] == 16
    with pytest.raises(ValueError):
        reference.dequant_fp8_blockwise(weight, scale[:1])


def test_swiglu_clamps_gate_above_and_up_both_sides():
    gate = torch.tensor([20.0, -20.0, 1.0])
    up = torch.tensor([-30.0, 30.0, 2.0])
    out = reference.swiglu_reference(gate, up, 10.0)
    silu = torch.nn.functional.silu
    assert torch.allclose(out, torch.stack([silu(torch.tensor(10.0)) * -10, silu(torch.tensor(-20.0)) * 10,
                                            silu(torch.tensor(1.0)) * 2]))
    assert torch.allclose(reference.swiglu_reference(gate, up, None), silu(gate) * up)


def test_sort_by_expert_offsets_and_combine():
    topk_ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    layout = sort_by_expert(topk_ids, num_experts=4)
    assert layout.expert_offsets.tolist() == [0, 2, 3, 6, 6]
    assert topk_ids.flatten()[layout.row_slot_ids].tolist() == [0, 0, 1, 2, 2, 2]
    assert layout.row_token_ids.tolist() == [0, 2, 1, 0, 1, 2]  # stable: token order within an expert
    rows = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 3)
    combined = combine_rows(rows, layout, num_tokens=3)
    assert combined[:, 0].tolist() == [0 + 3, 2 + 4, 1 + 5]


def _find(module, names):
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    pytest.skip(f"common.checkpoint.quant has none of {names}")


def test_bit_compatible_with_checkpoint_quant():
    """Our dequantizers and common.checkpoint.quant's must agree bit for bit (skips until it exists)."""
    try:
        quant = importlib.import_module("moemesh.common.checkpoint.quant")
    except ImportError:
        pytest.skip("common.checkpoint.quant not present yet")
    dequant_fp8 = _find(quant, ("dequantize_fp8_block", "dequantize_fp8", "dequantize_fp8_blockwise"))
    dequant_fp4 = _find(quant, ("dequantize_fp4", "dequant_fp4", "dequantize_mxfp4"))
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(200, 300, generator=generator) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.randint(110, 140, (2, 3), generator=generator, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    # Their block size is inferred from the scale grid unless given; for a ragged 300-wide weight
    # with 3 scale columns that guess is 100, so name the checkpoint's 128x128 explicitly.
    if "block_size" in inspect.signature(dequant_fp8).parameters:
        theirs = dequant_fp8(weight, scale, block_size=(128, 128)).to(torch.float32)
    else:
        theirs = dequant_fp8(weight, scale).to(torch.float32)
    assert torch.equal(theirs, reference.dequant_fp8_blockwise(weight, scale))
    packed = torch.randint(0, 256, (64, 64), generator=generator, dtype=torch.uint8).view(torch.int8)
    scale4 = torch.randint(110, 140, (64, 4), generator=generator, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    theirs4 = dequant_fp4(packed, scale4).to(torch.float32)
    assert torch.equal(theirs4, reference.dequant_fp4(packed, scale4))
