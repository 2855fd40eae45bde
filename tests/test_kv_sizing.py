"""KV pool sizing per layer type (common/model/kv_sizing.py) on the CPU: the segments of a block and their bytes from
the config's shapes, the pool allocating exactly them, tokens per tier, the start-up budget priced in the kv dtype,
the attention worker's capacity event, and `moemesh bench kv-bytes` measuring the goal's figure from the pool."""

from __future__ import annotations

import json

import pytest
import torch
from structlog.testing import capture_logs

from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.kv_layouts import IndexerRowLayout, MainRowLayout
from moemesh.common.model.kv_sizing import Element, KVPoolSizing, LayerType
from moemesh.common.model.kv_storage import KVStorage
from moemesh.common.model.presets import v4_flash_hub_dict
from moemesh.services.attention.kv_config import KVPoolConfig

FLASH = ModelConfig.from_dict(v4_flash_hub_dict())
BLOCK = 128


def _sizing(config: ModelConfig, storage: KVStorage, *, primary: int = 3, cpu: int = 5,
            activation_bytes: int = 2, snapshots: int = 7, cpu_snapshots: int = 2) -> KVPoolSizing:
    return KVPoolSizing.of(config, block_size_tokens=BLOCK, num_primary_blocks=primary, num_cpu_blocks=cpu,
                           kv_storage=storage, activation_bytes=activation_bytes, num_primary_snapshots=snapshots,
                           num_cpu_snapshots=cpu_snapshots)


def _layers(config: ModelConfig, kind: AttentionKind) -> list[int]:
    return [layer for layer, layer_kind in enumerate(config.layer_types) if layer_kind is kind]


@pytest.mark.parametrize("storage", list(KVStorage))
def test_each_layer_type_holds_its_rows_and_snapshots(storage):
    """Per layer type, row bytes of one block and bytes of one resume snapshot, from the config's fields and the
    row layouts; a block holds rows only, the snapshots are their own tier."""
    sizing = _sizing(FLASH, storage)
    csa, hca = _layers(FLASH, AttentionKind.CSA), _layers(FLASH, AttentionKind.HCA)
    fp8 = storage is KVStorage.FP8
    main_row = MainRowLayout.of(FLASH).row_bytes if fp8 else 2 * FLASH.head_dim
    indexer_row = IndexerRowLayout.of(FLASH).row_bytes if fp8 else 2 * FLASH.index_head_dim
    m_csa, m_hca = FLASH.csa_compress_ratio, FLASH.compress_ratio(hca[0])
    by_type = sizing.by_layer_type()
    assert set(by_type) == set(LayerType)
    window = by_type[LayerType.WINDOW]
    assert window.num_layers == FLASH.num_hidden_layers and window.row_bytes_per_block == 0
    assert window.snapshot_bytes == FLASH.num_hidden_layers * FLASH.sliding_window * main_row
    pending = lambda dim: 2 * m_csa * 2 * dim * 4  # noqa: E731 - K and Z of the previous window, fp32
    assert by_type[LayerType.CSA].num_layers == len(csa)
    assert by_type[LayerType.CSA].row_bytes_per_block == len(csa) * (BLOCK // m_csa) * main_row
    assert by_type[LayerType.CSA].snapshot_bytes == len(csa) * pending(FLASH.head_dim)
    assert by_type[LayerType.INDEXER].row_bytes_per_block == len(csa) * (BLOCK // m_csa) * indexer_row
    assert by_type[LayerType.INDEXER].snapshot_bytes == len(csa) * pending(FLASH.index_head_dim)
    assert by_type[LayerType.HCA].num_layers == len(hca)
    assert by_type[LayerType.HCA].row_bytes_per_block == len(hca) * (BLOCK // m_hca) * main_row
    assert by_type[LayerType.HCA].snapshot_bytes == 0
    assert sizing.bytes_per_block == sum(capacity.row_bytes_per_block for capacity in by_type.values())
    assert sizing.bytes_per_snapshot == sum(capacity.snapshot_bytes for capacity in by_type.values())
    for capacity in by_type.values():  # every block holds every type: the same tokens everywhere
        assert (capacity.primary_tokens, capacity.cpu_tokens) == (3 * BLOCK, 5 * BLOCK)
    assert sizing.primary_bytes == 3 * sizing.bytes_per_block + 7 * sizing.bytes_per_snapshot
    assert sizing.cpu_bytes == 5 * sizing.bytes_per_block + 2 * sizing.bytes_per_snapshot


def test_v4_flash_context_tokens_cost_the_production_figure_with_fp8_rows():
    """3,850 B per context token with FP8 main and indexer rows (within 5 %), 6,880 B in bf16: all a block holds."""
    fp8, bf16 = _sizing(FLASH, KVStorage.FP8), _sizing(FLASH, KVStorage.BF16)
    fp8_per_token = fp8.bytes_per_block / BLOCK
    assert abs(fp8_per_token - 3850) / 3850 < 0.05
    assert bf16.bytes_per_block / BLOCK == 6880
    by_type = fp8.by_layer_type()
    assert by_type[LayerType.INDEXER].row_bytes_per_token == 21 * 132 / 4  # the 132-byte indexer rows


@pytest.mark.parametrize("storage", list(KVStorage))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_pool_allocates_exactly_the_sizing(storage, dtype):
    from moemesh.bench.checks.tiny_model import tiny_config
    from moemesh.services.attention.kv_pool import KVPool

    for config in (tiny_config(), FLASH):
        device = "cpu" if config is not FLASH else "meta"
        pool = KVPool(config, KVPoolConfig(block_size_tokens=BLOCK, num_primary_blocks=2, num_cpu_blocks=1,
                                           kv_storage=storage, num_primary_snapshots=3, num_cpu_snapshots=4),
                      dtype, device)
        sizing = pool.sizing
        assert sizing.activation_bytes == dtype.itemsize
        assert set(pool.primary) == set(pool.cpu) == {segment.key for segment in sizing.row_segments}
        assert set(pool.snapshot_primary) == set(pool.snapshot_cpu) == {s.key for s in sizing.snapshot_segments}
        assert len(sizing.row_segments) + len(sizing.snapshot_segments) == len(sizing.segments)
        element_dtypes = {Element.FP8_BYTE: torch.uint8, Element.ACTIVATION: dtype, Element.FLOAT32: torch.float32}
        for segment in sizing.segments:
            tiers = (((pool.primary, 2), (pool.cpu, 1)) if segment.grows
                     else ((pool.snapshot_primary, 3), (pool.snapshot_cpu, 4)))
            for tier, entries in tiers:
                tensor = tier[segment.key]
                assert tensor.shape == (entries, segment.num_rows, segment.width), segment
                assert tensor.dtype == element_dtypes[segment.element]
                assert tensor[0].numel() * tensor.element_size() == segment.num_bytes
        assert pool.num_bytes_per_block() == sizing.bytes_per_block
        assert pool.num_bytes_per_snapshot() == sizing.bytes_per_snapshot


def test_bad_geometry_fails_naming_the_key():
    with pytest.raises(ValueError, match=r"block_size_tokens=96 is not a multiple of layer \d+'s compression "
                                         r"ratio 128"):
        KVPoolSizing.of(FLASH, block_size_tokens=96, num_primary_blocks=1, num_cpu_blocks=0,
                        kv_storage=KVStorage.FP8, activation_bytes=2)
    for key, value in (("block_size_tokens", 0), ("num_primary_blocks", 0), ("num_cpu_blocks", -1),
                       ("num_primary_snapshots", -1), ("num_cpu_snapshots", -2)):
        with pytest.raises(ValueError, match=f"{key}={value}"):
            KVPoolConfig(**{key: value})
    with pytest.raises(ValueError, match="activation_bytes=8"):
        _sizing(FLASH, KVStorage.BF16, activation_bytes=8)


def test_the_capacity_line_and_event_come_from_the_sizing():
    from moemesh.services.attention.kv_capacity import log_kv_capacity

    sizing = _sizing(FLASH, KVStorage.FP8, primary=256, cpu=512)
    assert sizing.capacity_line("cuda:0") == "KV capacity: 32,768 tokens on cuda:0, 65,536 on the CPU tier"
    with capture_logs() as logs:
        fields = log_kv_capacity("attention-0", sizing, "cuda:0")
    assert len(logs) == 1 and logs[0]["event"] == "attention.kv_capacity"
    assert logs[0]["message"] == sizing.capacity_line("cuda:0") and logs[0]["kv_dtype"] == "fp8"
    assert logs[0]["tokens"] == 256 * BLOCK and logs[0]["cpu_tier_tokens"] == 512 * BLOCK
    assert logs[0]["device_bytes"] == 256 * sizing.bytes_per_block + 7 * sizing.bytes_per_snapshot
    assert logs[0]["cpu_tier_bytes"] == 512 * sizing.bytes_per_block + 2 * sizing.bytes_per_snapshot
    assert logs[0]["by_layer_type"]["indexer"]["row_bytes_per_token"] == round(21 * 132 / 4, 2)
    assert logs[0]["bytes_per_token"] == round(sizing.bytes_per_block / BLOCK, 2) == 3850.25
    assert logs[0]["snapshots"] == 7 and logs[0]["bytes_per_snapshot"] == sizing.bytes_per_snapshot
    json.dumps(fields)  # the event's fields are JSON


def test_the_start_up_budget_prices_the_pool_in_the_kv_dtype():
    from moemesh.common.placement.worker_budget import attention_worker_budget, kv_block_bytes
    from moemesh.services.attention.kv_pool import KVPool

    budgets = {}
    for storage in KVStorage:
        budgets[storage] = attention_worker_budget(
            FLASH, service="attention", device="cuda:0", dtype="bfloat16", block_size_tokens=BLOCK,
            num_primary_blocks=4, num_cpu_blocks=100, free_bytes=1 << 50, kv_storage=storage,
            num_primary_snapshots=3, num_cpu_snapshots=50)
        pool = KVPool(FLASH, KVPoolConfig(block_size_tokens=BLOCK, num_primary_blocks=1, kv_storage=storage),
                      torch.bfloat16, "meta")
        assert kv_block_bytes(FLASH, BLOCK, 2, storage) == pool.num_bytes_per_block()
        # the CPU tier is not on the GPU
        assert budgets[storage].kv_pool_bytes == 4 * pool.num_bytes_per_block() + 3 * pool.num_bytes_per_snapshot()
    assert budgets[KVStorage.FP8].kv_pool_bytes < budgets[KVStorage.BF16].kv_pool_bytes
    cpu = attention_worker_budget(FLASH, service="attention", device="cpu", dtype="float32", block_size_tokens=BLOCK,
                                  num_primary_blocks=4, num_cpu_blocks=6, free_bytes=1 << 50,
                                  kv_storage=KVStorage.FP8)
    assert cpu.kv_pool_bytes == 10 * kv_block_bytes(FLASH, BLOCK, 4, KVStorage.FP8)  # on the CPU both tiers count


def test_the_attention_worker_budget_check_uses_its_kv_dtype(monkeypatch):
    """`_budget_fits` hands the worker's kv storage to the budget (a pool that fits in FP8 and not in bf16)."""
    import moemesh.common.placement.worker_budget as worker_budget
    from moemesh.common.runtime.deployment import parse_deployment
    from moemesh.services.attention import main as attention_main

    deployment = parse_deployment({"model": {"path": "m"}, "attention": [{"name": "attention-0", "device": "cuda:0"}],
                                   "expert": [{"name": "expert-0"}]}, [])
    entry = deployment.attention[0]
    seen = {}

    def budget(*args, **kwargs):
        seen.update(kwargs)
        return worker_budget.MemoryBudget("attention", "cuda:0", 1 << 40)

    monkeypatch.setattr(worker_budget, "attention_worker_budget", budget)
    monkeypatch.setattr(worker_budget, "measure_free_bytes", lambda device, limit=None: 1 << 40)
    kv = KVPoolConfig(block_size_tokens=BLOCK, num_primary_blocks=8, kv_storage=KVStorage.FP8)
    assert attention_main._budget_fits(entry, deployment, FLASH, kv, 0)
    assert seen["kv_storage"] is KVStorage.FP8 and seen["num_primary_blocks"] == 8


def test_bench_kv_bytes_measures_the_goal_from_the_pool(capsys):
    from moemesh.bench.kv_bytes import main

    assert main(["--kv-dtype", "fp8", "--json", "--device", "meta"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert main(["--kv-dtype", "bf16", "--json", "--device", "meta"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    sizing = _sizing(FLASH, KVStorage.FP8)
    assert fp8["total_bytes_per_token"] == fp8["pool_block_bytes_per_token"] == sizing.bytes_per_block / BLOCK
    assert abs(fp8["total_bytes_per_token"] - 3850) / 3850 < 0.05 and abs(fp8["ratio_to_target"] - 1) < 0.05
    assert fp8["indexer_bytes_per_token"] == sizing.by_layer_type()[LayerType.INDEXER].row_bytes_per_token
    types = {entry["layer_type"]: entry for entry in fp8["layer_types"]}
    assert types["indexer"]["row_bytes"] == 132 and types["csa"]["row_bytes"] == 584
    assert types["window"]["bytes_per_token"] == 0 and types["window"]["snapshot_bytes"] > 0
    assert fp8["snapshot_bytes"] == sizing.bytes_per_snapshot
    assert bf16["total_bytes_per_token"] == 6880 and bf16["ratio_to_target"] > 1.7
