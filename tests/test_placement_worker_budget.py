"""The startup budget on every worker: planned bytes match what the worker allocates, a worker
whose plan does not fit its device (here: a `memory_limit` below the plan) exits non-zero with a
message naming the device and the shortfall, and LoadExperts beyond the budget is refused."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.placement.budget import MemoryBudget
from moemesh.common.placement.worker_budget import (
    attention_worker_budget, check_at_start, draft_weight_bytes, draft_worker_budget, expert_headroom_bytes,
    expert_worker_budget, kv_block_bytes, measure_free_bytes, resident_bytes_per_expert,
)
from moemesh.common.wire.messages import ErrorReply, ExpertInventory, ExpertKey, LoadExperts

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_kv_block_bytes_equal_the_pool_the_attention_worker_allocates():
    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.services.attention.kv_pool import KVPool

    config = tiny_config()
    pool = KVPool(config, KVPoolConfig(block_size_tokens=128, num_primary_blocks=2, num_cpu_blocks=0), torch.float32,
                  "cpu")
    assert kv_block_bytes(config, 128, 4) == pool.num_bytes_per_block()


def test_expert_budget_counts_the_held_pairs_and_leaves_the_rest_for_experts():
    config = tiny_config()
    per_expert = resident_bytes_per_expert(config)
    matrix = config.moe_intermediate_size * config.hidden_size
    assert per_expert == 3 * (matrix // 2 + matrix // 32)  # FP4 e2m1 + ue8m0 per 32, as stored
    assert resident_bytes_per_expert(config, "fp8") == 3 * (matrix + 1)  # e4m3 + one 128x128 block scale
    assert resident_bytes_per_expert(config, "bf16") == 3 * matrix * 2
    budget = expert_worker_budget(config, service="expert", device="cpu", dtype="auto", num_pairs=10,
                                  free_bytes=1 << 40)
    assert budget.expert_bytes == 10 * per_expert and budget.fits
    assert budget.load_peak_bytes >= 8 * per_expert  # a restacked layer (8 experts) beside the old one
    assert expert_headroom_bytes(budget) == (1 << 40) - budget.needed_bytes + budget.expert_bytes
    attention = attention_worker_budget(config, service="attention", device="cuda:0", dtype="auto",
                                        block_size_tokens=128, num_primary_blocks=4, num_cpu_blocks=100,
                                        free_bytes=1 << 40)
    assert attention.kv_pool_bytes == 4 * kv_block_bytes(config, 128, 2)  # the CPU tier is not on the GPU
    assert attention.weights_bytes > 0 and attention.activation_bytes > 0 and attention.load_peak_bytes > 0
    drafting = attention_worker_budget(config, service="attention", device="cuda:0", dtype="auto",
                                       block_size_tokens=128, num_primary_blocks=4, num_cpu_blocks=100,
                                       free_bytes=1 << 40, with_drafter=True)  # [draft] placement = "attention"
    drafter_alone = draft_worker_budget(config, service="draft", device="cuda:0", dtype="auto", free_bytes=1 << 40)
    assert drafting.weights_bytes == attention.weights_bytes + draft_weight_bytes(config, 2)
    assert drafting.activation_bytes == attention.activation_bytes + drafter_alone.activation_bytes


@pytest.mark.parametrize("dtype, element_bytes", [("float32", 4), ("bfloat16", 2)])
def test_draft_budget_equals_what_the_drafter_holds_with_its_own_embedding_and_head(tmp_path, dtype, element_bytes):
    from moemesh.common.checkpoint.side_loading import drafter_resident_bytes
    from moemesh.common.model.config import NumericsConfig
    from moemesh.common.drafting.proposer import load_drafter

    config = tiny_config(num_nextn_predict_layers=2, compress_ratios=[0, 4, 128, 4, 0, 0], dspark_block_size=4,
                         dspark_markov_rank=32, dspark_target_layer_ids=[1, 2, 3], dspark_noise_token_id=255)
    path = write_checkpoint(tmp_path / "dspark", config, random_hub_state_dict(config, seed=8))
    drafter = load_drafter(str(path), "cpu", NumericsConfig(dtype=dtype))
    embed_and_head = sum(t.numel() * t.element_size() for t in (drafter.embed.weight, drafter.head.weight))
    assert embed_and_head == 2 * config.vocab_size * config.hidden_size * 2  # bf16 as stored
    assert draft_weight_bytes(config, element_bytes) == drafter_resident_bytes(drafter)


def test_check_at_start_logs_the_budget_and_names_device_and_shortfall():
    budget = MemoryBudget("expert", "cuda:3", free_bytes=1 << 30, expert_bytes=3 << 30)
    with capture_logs() as logs:
        refusal = check_at_start(budget, "expert-7")
    assert refusal is not None and "expert-7" in refusal and "cuda:3" in refusal and "short by" in refusal
    assert logs[0]["event"] == "expert.memory_budget" and logs[0]["fits"] is False
    assert check_at_start(MemoryBudget("expert", "cpu", free_bytes=1 << 30), "expert-0") is None


def test_measured_free_memory_is_capped_by_the_limit():
    assert 0 < measure_free_bytes("cpu")
    assert measure_free_bytes("cpu", "1MiB") == 1 << 20


def test_load_experts_beyond_the_budget_is_refused(tmp_path):
    from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig

    config = tiny_config()
    path = write_checkpoint(tmp_path / "ckpt", config, random_hub_state_dict(config, seed=3, include_mtp=False))
    per_expert = resident_bytes_per_expert(config)
    worker = ExpertWorker(ExpertWorkerConfig(name="expert-b", checkpoint_path=str(path),
                                             expert_budget_bytes=3 * per_expert), config)
    fits = asyncio.run(worker.handle(LoadExperts(1, (ExpertKey(0, 0), ExpertKey(0, 1)))))
    assert isinstance(fits, ExpertInventory) and fits.free_budget_bytes == per_expert
    refused = asyncio.run(worker.handle(LoadExperts(2, (ExpertKey(1, 0), ExpertKey(1, 1)))))
    assert isinstance(refused, ErrorReply) and "short by" in refused.message and "cpu" in refused.message
    assert len(worker.inventory().experts) == 2  # nothing of the refused load was read


@pytest.fixture(scope="module")
def deployment_file(tmp_path_factory) -> Path:
    config = tiny_config()
    root = tmp_path_factory.mktemp("budget")
    path = write_checkpoint(root / "ckpt", config, random_hub_state_dict(config, seed=5, include_mtp=False))
    text = (f'[model]\npath = "{path}"\n\n[paths]\nrun_dir = "{root / "run"}"\nlog_dir = "{root / "logs"}"\n\n'
            '[[attention]]\nname = "attention-0"\ndevice = "cpu"\nmemory_limit = "1MiB"\n\n'
            '[[expert]]\nname = "expert-0"\ndevice = "cpu"\nmemory_limit = "64KiB"\n')
    config_path = root / "deployment.toml"
    config_path.write_text(text)
    return config_path


@pytest.mark.parametrize("role, name", [("expert", "expert-0"), ("attention", "attention-0")])
def test_a_worker_that_cannot_fit_exits_naming_device_and_shortfall(deployment_file, role, name):
    result = subprocess.run([sys.executable, "-m", "moemesh.cli", role, "--config", str(deployment_file),
                             "--name", name], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 3, result.stderr[-2000:]
    assert f"{name}: refusing to start: {role} on cpu: needs" in result.stderr
    assert "short by" in result.stderr
    assert f"{role}.memory_budget" in result.stderr  # the structured budget event came first
