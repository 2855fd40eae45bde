"""Tensor inventory of hub checkpoints (docs/model.md §4.2, §8; docs/speculation.md §3)."""

from __future__ import annotations

from collections import Counter

import pytest

from moemesh.common.model.inventory import ParamGroup, StorageKind, tensor_inventory
from tiny_checkpoint_support import tiny_config
from moemesh.common.model.config import ModelConfig

_FLASH = {
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "num_hash_layers": 3,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "expert_dtype": "fp4",
}


@pytest.fixture(scope="module")
def flash_inventory():
    return tensor_inventory(ModelConfig.from_dict(_FLASH))


def _entries_by_owner(inventory) -> Counter:
    counts: Counter = Counter()
    for spec in inventory.values():
        owner = "mtp" if spec.is_mtp else ("top" if spec.layer is None else spec.layer)
        counts[owner] += len(spec.stored_entries())
    return counts


def test_flash_entry_counts_match_published_checkpoint(flash_inventory):
    counts = _entries_by_owner(flash_inventory)
    # docs/model.md §4.2: 1565 per window-only hash layer, 1576 CSA, 1569 HCA, 6 top-level, 1575 MTP
    assert counts["top"] == 6
    assert counts[0] == counts[1] == 1565
    assert counts[2] == counts[4] == 1576
    assert counts[3] == 1569
    assert counts["mtp"] == 1575
    assert sum(counts.values()) == 69187


def test_flash_params_and_bytes_by_group(flash_inventory):
    params, num_bytes = Counter(), Counter()
    for spec in flash_inventory.values():
        params[spec.group] += spec.num_params
        num_bytes[spec.group] += spec.num_bytes
    assert sum(params.values()) == pytest.approx(290.94e9, rel=1e-4)
    assert sum(num_bytes.values()) == pytest.approx(159.61e9, rel=1e-4)
    assert params[ParamGroup.ROUTED_EXPERT] == pytest.approx(277.03e9, rel=1e-4)
    assert num_bytes[ParamGroup.ROUTED_EXPERT] == pytest.approx(147.17e9, rel=1e-4)
    assert num_bytes[ParamGroup.MTP] == pytest.approx(3.59e9, rel=2e-3)  # spec rounds to 3.59 GB
    assert params[ParamGroup.MTP] == pytest.approx(6.61e9, rel=1e-3)


def test_flash_shapes_dtypes_and_roles(flash_inventory):
    wq_a = flash_inventory["layers.5.attn.wq_a.weight"]
    assert wq_a.storage is StorageKind.FP8_BLOCK and wq_a.is_attention_side
    assert [(e.name, e.shape, e.dtypes) for e in wq_a.stored_entries()] == [
        ("layers.5.attn.wq_a.weight", (1024, 4096), ("F8_E4M3",)),
        ("layers.5.attn.wq_a.scale", (8, 32), ("F8_E8M0",)),
    ]
    w2 = flash_inventory["layers.7.ffn.experts.200.w2.weight"]
    assert (w2.layer, w2.expert, w2.is_attention_side) == (7, 200, False)
    assert [(e.shape, e.dtypes) for e in w2.stored_entries()] == [((4096, 1024), ("I8",)), ((4096, 64), ("F8_E8M0",))]
    assert flash_inventory["layers.1.ffn.gate.tid2eid"].stored_entries()[0].shape == (129280, 6)
    assert "layers.3.ffn.gate.tid2eid" not in flash_inventory and "layers.2.ffn.gate.bias" not in flash_inventory
    assert flash_inventory["layers.3.attn.compressor.ape"].shape == (128, 512)
    assert flash_inventory["layers.4.attn.compressor.ape"].shape == (4, 1024)
    assert flash_inventory["layers.4.attn.indexer.wq_b.scale".replace(".scale", ".weight")].shape == (8192, 1024)
    assert "layers.3.attn.indexer.wq_b.weight" not in flash_inventory
    assert flash_inventory["mtp.0.e_proj.weight"].is_mtp and not flash_inventory["mtp.0.e_proj.weight"].is_attention_side
    assert flash_inventory["mtp.0.ffn.gate.bias"].storage is StorageKind.F32


def test_unquantized_config_has_no_scales():
    config = tiny_config(quantization_config=None, expert_dtype="bf16")
    inventory = tensor_inventory(config)
    assert not any(name.endswith(".scale") for spec in inventory.values() for name in
                   (e.name for e in spec.stored_entries()))
    assert inventory["layers.0.attn.wq_a.weight"].storage is StorageKind.FLOAT
    assert inventory["layers.0.ffn.experts.3.w1.weight"].storage is StorageKind.FLOAT
    assert inventory["layers.0.attn_norm.weight"].storage is StorageKind.BF16


def test_dspark_stages_are_listed():
    config = tiny_config(num_nextn_predict_layers=3, compress_ratios=[0, 4, 128, 4, 0, 0, 0],
                         dspark_block_size=5, dspark_markov_rank=32, dspark_target_layer_ids=[1, 2, 3],
                         dspark_noise_token_id=255)
    inventory = tensor_inventory(config)
    assert inventory["mtp.0.main_proj.weight"].shape == (128, 3 * 128)
    assert inventory["mtp.0.main_proj.weight"].storage is StorageKind.FP8_BLOCK
    assert inventory["mtp.2.markov_head.markov_w1.weight"].shape == (256, 32)
    assert inventory["mtp.2.markov_head.markov_w2.weight"].shape == (256, 32)
    assert inventory["mtp.2.confidence_head.proj.weight"].shape == (1, 128 + 32)
    assert "mtp.2.hc_head_fn" in inventory and "mtp.0.hc_head_fn" not in inventory
    for j in range(3):
        assert f"mtp.{j}.ffn.gate.bias" in inventory and f"mtp.{j}.attn.wq_a.weight" in inventory
        assert f"mtp.{j}.attn.compressor.wkv.weight" not in inventory
        assert f"mtp.{j}.e_proj.weight" not in inventory
    assert all(spec.group is ParamGroup.MTP for spec in inventory.values() if spec.is_mtp)
