"""`moemesh serve --kv-tokens / --kv-cpu-tokens / --max-model-len / --gpu-memory-utilization`: the [kv] table serve
writes, the auto-sized pool against the workers' start-up budgets, and the router's max_model_len."""

from __future__ import annotations

import dataclasses

import pytest

from moemesh.commands.serve import _size_kv
from moemesh.commands.serve_config import DEFAULT_MODEL_DIR, ServeLayout, deployment_table, write_deployment
from moemesh.commands.serve_kv import (auto_device_blocks, check_max_model_len, parse_kv_request,
                                       planned_bytes_beside_kv)
from moemesh.common.model.config import ModelConfig
from moemesh.common.model.kv_storage import KVStorage
from moemesh.common.placement.worker_budget import attention_worker_budget, expert_worker_budget
from moemesh.common.runtime.deployment import DeploymentError, parse_deployment


def _layout(tmp_path, **changes) -> ServeLayout:
    changes.setdefault("experts_in_attention", "all")
    return ServeLayout(model_path=str(DEFAULT_MODEL_DIR), run_dir=str(tmp_path), log_dir=str(tmp_path / "logs"),
                       **changes)


def test_flags_are_checked():
    request = parse_kv_request("131_072", 0, 65536, 0.9)
    assert (request.device_tokens, request.cpu_tokens, request.max_model_len) == (131072, 0, 65536)
    assert parse_kv_request("AUTO", 128, None, 0.5).device_tokens is None
    for args, flag in ((("lots", 0, None, 0.9), "--kv-tokens"), (("0", 0, None, 0.9), "--kv-tokens"),
                       (("128", -1, None, 0.9), "--kv-cpu-tokens"), (("128", 0, 1, 0.9), "--max-model-len"),
                       (("auto", 0, None, 1.5), "--gpu-memory-utilization")):
        with pytest.raises(ValueError, match=flag):
            parse_kv_request(*args)


def test_tokens_become_blocks_and_reach_the_router(tmp_path):
    from moemesh.services.router.main import build_configs
    from moemesh.services.router.app import load_tokenizer

    layout = _size_kv(_layout(tmp_path), parse_kv_request("1000", 300, 900, 0.9), DEFAULT_MODEL_DIR)
    assert (layout.kv_num_primary_blocks, layout.kv_num_cpu_blocks, layout.max_model_len) == (8, 3, 900)
    _, deployment = write_deployment(layout)
    assert (deployment.kv.num_primary_blocks, deployment.kv.num_cpu_blocks, deployment.kv.max_model_len) == (8, 3, 900)
    configs = build_configs(deployment, load_tokenizer(str(DEFAULT_MODEL_DIR)))
    assert configs.scheduler.num_gpu_blocks == 8 and configs.scheduler.num_cpu_blocks == 3
    assert configs.scheduler.max_model_len == 900 and configs.gateway.max_model_len == 900
    unset = _size_kv(_layout(tmp_path), parse_kv_request("1000", 0, None, 0.9), DEFAULT_MODEL_DIR)
    configs = build_configs(write_deployment(unset)[1], load_tokenizer(str(DEFAULT_MODEL_DIR)))
    assert configs.scheduler.max_model_len == 1024  # the pool (8 blocks) caps the model's 4,096 positions


def test_lengths_past_the_pool_or_the_model_fail_naming_why(tmp_path):
    with pytest.raises(ValueError, match="does not fit the device KV pool of 1024 tokens"):
        _size_kv(_layout(tmp_path), parse_kv_request("1000", 0, 2000, 0.9), DEFAULT_MODEL_DIR)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        _size_kv(_layout(tmp_path), parse_kv_request("65536", 0, 8192, 0.9), DEFAULT_MODEL_DIR)
    check_max_model_len(0, 10, 1)  # unset: nothing to check
    table = deployment_table(_layout(tmp_path, kv_num_primary_blocks=2, max_model_len=300))
    with pytest.raises(DeploymentError, match="kv.max_model_len"):
        parse_deployment(table)
    from moemesh.services.router.main import _max_model_len

    assert _max_model_len(0, 4096, 1024) == 1024 and _max_model_len(2048, 4096, 8192) == 2048
    with pytest.raises(DeploymentError, match="kv.max_model_len"):
        _max_model_len(8192, 4096, 8192)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_auto_pool_fits_the_attention_budget_and_no_more(tmp_path, kv_dtype):
    config = ModelConfig.load(DEFAULT_MODEL_DIR)
    layout = _layout(tmp_path, devices=("cuda:0",), kv_dtype=kv_dtype, with_drafter=True, kv_num_cpu_blocks=4)
    deployment = parse_deployment(deployment_table(layout))
    planned, block_bytes = planned_bytes_beside_kv(deployment, config)
    free = 10 * 2**30
    blocks = auto_device_blocks(free, 0.5, planned, block_bytes, "cuda:0")

    def needed(num_blocks: int) -> int:  # what the attention worker's own start-up check will price
        return attention_worker_budget(
            config, service="attention", device="cuda:0", dtype="auto", block_size_tokens=128,
            num_primary_blocks=num_blocks, num_cpu_blocks=4, free_bytes=free,
            num_local_pairs=config.num_hidden_layers * config.n_routed_experts,
            kv_storage=KVStorage(kv_dtype), with_drafter=True,
            num_primary_snapshots=deployment.kv.num_primary_snapshots,
            num_cpu_snapshots=deployment.kv.num_cpu_snapshots).needed_bytes

    # experts and drafter in the attention worker; the expert worker joins empty but plans its activations
    empty_expert = expert_worker_budget(config, service="expert", device="cuda:0", dtype="auto", num_pairs=0,
                                        free_bytes=free).needed_bytes
    assert planned == needed(0) + empty_expert
    # and no more than a rounding's worth below it (a byte per block of rounding on top of the block's reserve)
    assert needed(blocks) + empty_expert <= free * 0.5 < needed(blocks + 2 + blocks // 1000) + empty_expert
    with pytest.raises(ValueError, match="no room for KV on cuda:0"):
        auto_device_blocks(planned, 0.9, planned, block_bytes, "cuda:0")


def test_auto_pool_counts_expert_workers_on_the_same_device(tmp_path):
    config = ModelConfig.load(DEFAULT_MODEL_DIR)
    table = deployment_table(_layout(tmp_path, devices=("cuda:0",), experts_in_attention="none"))
    on_gpu, _ = planned_bytes_beside_kv(parse_deployment(table), config)
    table["expert"][0]["device"] = "cpu"
    on_cpu, block_bytes = planned_bytes_beside_kv(parse_deployment(table), config)
    expert = expert_worker_budget(config, service="expert", device="cuda:0", dtype="auto",
                                  num_pairs=config.num_hidden_layers * config.n_routed_experts, free_bytes=0)
    assert on_gpu - on_cpu == expert.needed_bytes  # an expert worker on the CPU takes nothing from the GPU
    assert block_bytes > 0
