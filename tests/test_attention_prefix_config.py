"""The deployment's [kv] table is the one KV geometry of the router's scheduler and the attention worker."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from moemesh.commands.serve_config import ServeLayout, deployment_table
from moemesh.common.runtime.deployment_writer import write_deployment_file
from moemesh.common.runtime.deployment import DeploymentError, KVConfig, load_deployment
from moemesh.services.attention.main import add_attention_arguments, kv_pool_config, options_from_args
from moemesh.services.router.main import RouterSettings, build_configs

REPO_ROOT = Path(__file__).resolve().parents[1]


def _deployment(tmp_path, kv: dict | None, overrides=()):
    model_dir = tmp_path / "m"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 100_000, "eos_token_id": 1}))
    table = deployment_table(ServeLayout(model_path=str(model_dir), run_dir=str(tmp_path), log_dir=str(tmp_path)))
    if kv is not None:
        table["kv"] = kv
    path = tmp_path / "deployment.toml"
    write_deployment_file(path, table)
    return load_deployment(path, overrides)


def test_router_and_attention_worker_read_the_same_kv_table(tmp_path):
    from tokenizers import Tokenizer

    deployment = _deployment(tmp_path, {"block_size_tokens": 256, "num_primary_blocks": 9, "num_cpu_blocks": 5},
                             overrides=["kv.num_cpu_blocks=7"])
    tokenizer = Tokenizer.from_file(str(REPO_ROOT / "models" / "kjv-dsv4-mini" / "tokenizer.json"))
    scheduler = build_configs(deployment, tokenizer).scheduler
    parser = argparse.ArgumentParser()
    add_attention_arguments(parser)
    options = options_from_args(parser.parse_args([]))
    assert options.kv is None  # no --kv-*: the worker sizes its pool from the deployment
    pool = kv_pool_config(deployment)
    assert (scheduler.block_size_tokens, scheduler.num_gpu_blocks, scheduler.num_cpu_blocks) == (256, 9, 7)
    assert (pool.block_size_tokens, pool.num_primary_blocks, pool.num_cpu_blocks) == (256, 9, 7)
    assert scheduler.max_model_len == 9 * 256 and scheduler.enable_prefix_caching


def test_defaults_turn_on_prefix_caching_and_a_cpu_tier(tmp_path):
    deployment = _deployment(tmp_path, None)
    assert deployment.kv == KVConfig() and deployment.kv.prefix_caching and deployment.kv.num_cpu_blocks > 0
    off = _deployment(tmp_path, None, overrides=["kv.prefix_caching=false"])
    assert not off.kv.prefix_caching
    assert RouterSettings().enable_prefix_caching is None  # None: the deployment decides


@pytest.mark.parametrize("key, value", [("block_size_tokens", 0), ("num_primary_blocks", 0), ("num_cpu_blocks", -1)])
def test_bad_kv_tables_are_refused_naming_the_key(tmp_path, key, value):
    with pytest.raises(DeploymentError, match=f"kv.{key}"):
        _deployment(tmp_path, None, overrides=[f"kv.{key}={value}"])
