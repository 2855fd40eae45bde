"""FP8 KV rows: the 584-byte main row and the 132-byte indexer row of V4-Flash, packed and unpacked in torch, and
the KV bytes one context token costs the whole model (docs/model.md has the layout and the budget)."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.model.config import ModelConfig
from moemesh.common.model.kv_rows import (
    IndexerRowLayout, KVStorage, MainRowLayout, kv_bytes_per_token, pack_indexer_rows, pack_main_rows,
    unpack_indexer_rows, unpack_main_rows,
)
from moemesh.common.model.presets import v4_flash_hub_dict
from moemesh.common.model.qat import indexer_fp8_qat, kv_nope_fp8_qat

FLASH = ModelConfig.from_dict(v4_flash_hub_dict())


def _rows(shape, seed: int, spread: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, generator=generator)
    return rows * torch.exp(spread * torch.randn(*shape[:-1], 1, generator=generator))  # rows of very different sizes


def test_flash_rows_have_the_production_sizes():
    assert MainRowLayout.of(FLASH) == MainRowLayout(448, 64)
    assert MainRowLayout.of(FLASH).row_bytes == 584 and IndexerRowLayout(FLASH.index_head_dim).row_bytes == 132


@pytest.mark.parametrize("nope, rope", [(448, 64), (24, 8), (100, 28)])
def test_reference_qat_rows_pack_and_unpack_to_themselves(nope, rope):
    """The reference's FP8 QAT values are e4m3 codes times the block's power of two: storing them is lossless,
    so FP8 storage with kv_fp8_qat on computes the reference's numbers."""
    layout = MainRowLayout(nope, rope)
    qat = kv_nope_fp8_qat(_rows((33, nope + rope), seed=nope), nope)  # [R, N + P] fp32
    qat[:, nope:] = qat[:, nope:].to(torch.bfloat16).float()  # the rope tail is stored in bf16
    packed = pack_main_rows(qat, layout)
    assert packed.dtype == torch.uint8 and packed.shape == (33, layout.row_bytes)
    assert torch.equal(unpack_main_rows(packed, layout), qat)


def test_any_row_packs_to_the_reference_qat_values_and_its_exact_bytes():
    layout = MainRowLayout(448, 64)
    rows = _rows((2, 3, 512), seed=5).to(torch.bfloat16)  # leading dims kept
    unpacked = unpack_main_rows(pack_main_rows(rows, layout), layout)
    assert unpacked.shape == (2, 3, 512)
    want = kv_nope_fp8_qat(rows.float(), 448)
    assert torch.equal(unpacked[..., :448], want[..., :448]) and torch.equal(unpacked[..., 448:], rows[..., 448:].float())
    # one row by hand: block 0 all 1.0 -> scale 2^-8 (1/448 rounded up), code 256 = 0x78 in e4m3; the ue8m0 byte
    row = torch.zeros(1, 512)
    row[0, :64] = 1.0
    row[0, 448] = 2.5
    packed = pack_main_rows(row, layout)[0]
    assert packed[0].item() == 0x78 and packed[576].item() == 127 - 8
    assert packed[577].item() == 127 - 22  # an all-zero block: amax floored at 1e-4 -> 2^-22
    assert packed[448:450].view(torch.bfloat16).item() == 2.5 and packed[583].item() == 0  # rope in bf16, the pad


def test_indexer_rows_round_trip_within_e4m3_precision():
    layout = IndexerRowLayout(128)
    rows = _rows((40, 128), seed=11)
    packed = pack_indexer_rows(rows, layout)
    assert packed.shape == (40, 132)
    restored = unpack_indexer_rows(packed, layout)
    scale = packed[:, 128:].contiguous().view(torch.float32)  # [R, 1]
    assert bool((torch.frexp(scale)[0] == 0.5).all())  # powers of two (ue8m0 values held as fp32)
    assert bool((scale >= rows.abs().amax(dim=-1, keepdim=True) / 448).all())  # no code past 448
    assert bool((scale < 2 * rows.abs().amax(dim=-1, keepdim=True) / 448).all())  # the smallest such power
    # e4m3 keeps 3 mantissa bits: half a unit in the last place of |x| / scale, at most 2^-4 relative (normals),
    # half the subnormal step 2^-9 below 2^-6
    assert bool(((restored - rows).abs() <= rows.abs() * 2 ** -4 + scale * 2 ** -10).all())
    assert not torch.equal(restored, rows)  # the comparison can fail: FP8 does round


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_indexer_rows_pack_to_the_qat_values_which_pack_to_themselves(dtype):
    """Packing any row gives `indexer_fp8_qat`'s values (decoded in the row's dtype), and rows that QAT already
    rounded pack and unpack to exactly themselves: FP8 indexer storage with kv_fp8_qat on changes nothing."""
    layout = IndexerRowLayout(128)
    rows = _rows((3, 50, 128), seed=13).to(dtype)  # leading dims kept
    rows[0, 0] = 0.0  # the amax floor
    rows[0, 1, 0] = 1.0  # one large value, the rest far below: e4m3 subnormal codes
    rows[0, 1, 1:] *= 1e-4
    qat = indexer_fp8_qat(rows)  # [3, 50, 128] in dtype
    assert qat.dtype == dtype and not torch.equal(qat, rows)
    packed = pack_indexer_rows(rows, layout)
    assert packed.shape == (3, 50, 132)
    assert torch.equal(unpack_indexer_rows(packed, layout).to(dtype), qat)
    again = pack_indexer_rows(qat, layout)
    assert torch.equal(unpack_indexer_rows(again, layout).to(dtype), qat)


def test_an_indexer_row_by_hand():
    layout = IndexerRowLayout(128)
    row = torch.zeros(2, 128)
    row[0] = 1.0  # amax 1 -> scale 2^ceil(log2(1/448)) = 2^-8, code 256 = 0x78 in e4m3
    row[0, 5] = -3.0  # amax 3 -> scale 2^-7: 1.0 -> code 128 (0x70), -3.0 -> code -384 (0xFC: 1.5 · 2^8)
    packed = pack_indexer_rows(row, layout)
    assert packed[0, 0].item() == 0x70 and packed[0, 5].item() == 0xFC
    assert packed[0, 128:].view(torch.float32).item() == 2.0 ** -7
    assert packed[1, 128:].view(torch.float32).item() == 2.0 ** -22  # all zero: amax floored at 1e-4
    assert bool((packed[1, :128] == 0).all())


def test_flash_kv_bytes_per_context_token():
    """V4-Flash: 21 CSA layers (ratio 4, with an indexer) and 20 HCA layers (ratio 128) grow with the context."""
    fp8, bf16 = kv_bytes_per_token(FLASH, KVStorage.FP8), kv_bytes_per_token(FLASH, KVStorage.BF16)
    assert fp8.per_token_by_kind == {"csa": 21 * 584 / 4, "csa_indexer": 21 * 132 / 4, "hca": 20 * 584 / 128}
    assert abs(fp8.per_token - 3850) / 3850 < 0.05 and round(fp8.per_token) == 3850
    assert bf16.per_token == 21 * 1024 / 4 + 21 * 256 / 4 + 20 * 1024 / 128 == 6880
    assert fp8.window_bytes_per_sequence == 43 * 128 * 584 and bf16.window_bytes_per_sequence == 43 * 128 * 1024
