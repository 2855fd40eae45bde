"""`moemesh serve`'s deployment file, its model check, and the router's import hygiene."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moemesh.cli import main as cli_main
from moemesh.commands.serve_config import DEFAULT_MODEL_DIR, ServeLayout, expert_devices, write_deployment
from moemesh.common.checkpoint.model_dir import ModelMissing, check_model_dir
from moemesh.common.runtime.deployment import derive_endpoints
from moemesh.services.router.main import RouterSettings, build_configs

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_written_deployment_loads_back(tmp_path):
    layout = ServeLayout(model_path="/models/x", run_dir=str(tmp_path), log_dir=str(tmp_path / "logs"),
                         port=8123, num_expert_workers=3, devices=("cuda:0", "cpu"), dtype="float32",
                         placement_path=str(tmp_path / "placement.toml"))
    path, deployment = write_deployment(layout)
    assert path == tmp_path / "deployment.toml"
    assert deployment.model.path == "/models/x" and deployment.model.dtype == "float32"
    assert deployment.router.port == 8123
    assert [w.device for w in deployment.attention] == ["cuda:0"]
    assert [(w.name, w.device) for w in deployment.expert] == [("expert-0", "cuda:0"), ("expert-1", "cpu"),
                                                               ("expert-2", "cuda:0")]
    assert {w.placement for w in deployment.expert} == {str(tmp_path / "placement.toml")}
    endpoints = derive_endpoints(deployment)
    assert endpoints.supervisor == f"ipc://{tmp_path}/supervisor.sock"


def test_experts_in_attention_resolve_and_reach_the_deployment(tmp_path):
    from moemesh.commands.serve import _experts_in_attention

    assert _experts_in_attention("auto", ("cpu",), None, "native") == "all"
    assert _experts_in_attention("auto", ("cuda:0",), 2, "native") == "none"  # asked for expert workers
    assert _experts_in_attention("auto", ("cuda:0", "cuda:1"), None, "native") == "none"
    assert _experts_in_attention("auto", ("cuda:0",), None, "fp8") == "none"  # converting needs an expert worker
    with pytest.raises(ValueError, match="as stored"):
        _experts_in_attention("all", ("cuda:0",), None, "fp8")
    with pytest.raises(ValueError, match="placement file"):
        _experts_in_attention(str(tmp_path / "absent.toml"), ("cpu",), None, "native")
    layout = ServeLayout(model_path="/models/x", run_dir=str(tmp_path), log_dir=str(tmp_path / "logs"),
                         num_expert_workers=2, experts_in_attention="all")
    _, deployment = write_deployment(layout)
    assert deployment.attention[0].placement == "all"
    assert [w.placement for w in deployment.expert] == ["none", "none"]


def test_expert_devices_round_robin():
    assert expert_devices(("cpu",), 3) == ["cpu", "cpu", "cpu"]
    assert expert_devices(("cuda:0", "cuda:1"), 3) == ["cuda:0", "cuda:1", "cuda:0"]


def test_model_without_weights_fails_clearly(tmp_path, capsys):
    tokenizer_only = tmp_path / "kjv-dsv4-mini"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelMissing, match="kjv-dsv4-mini.*config.json.*safetensors"):
        check_model_dir(tokenizer_only)
    assert cli_main(["serve", "--model", str(tokenizer_only), "--run-dir", str(tmp_path / "run")]) == 2
    assert f"model directory {tokenizer_only}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_default_model_is_the_embedded_one():
    assert DEFAULT_MODEL_DIR == REPO_ROOT / "models" / "kjv-dsv4-mini"


def test_router_configs_from_deployment(tmp_path):
    from tokenizers import Tokenizer

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 100_000, "eos_token_id": 1}))
    _, deployment = write_deployment(ServeLayout(model_path=str(model_dir), run_dir=str(tmp_path),
                                                 log_dir=str(tmp_path / "logs"), num_expert_workers=2))
    tokenizer = Tokenizer.from_file(str(REPO_ROOT / "models" / "kjv-dsv4-mini" / "tokenizer.json"))
    settings = RouterSettings(num_gpu_blocks=64)
    configs = build_configs(deployment, tokenizer, settings)
    assert configs.scheduler.max_model_len == 64 * 128  # bounded by the KV pool, not the model
    assert configs.gateway.max_model_len == configs.scheduler.max_model_len
    assert configs.engine.eos_token_ids == (1,) and configs.gateway.eos_token_ids == (1,)
    assert configs.engine.required_worker_names == ("attention-0", "expert-0", "expert-1")
    assert configs.engine.attention_endpoint == derive_endpoints(deployment).attention["attention-0"]
    assert configs.gateway.model_name == "m"
    assert configs.scheduler.enable_prefix_caching and configs.scheduler.num_cpu_blocks == deployment.kv.num_cpu_blocks


def test_router_and_serve_never_import_torch():
    code = ("import sys; import moemesh.services.router.main, moemesh.services.router.engine, moemesh.commands.serve, "
            "moemesh.common.runtime.launcher; import moemesh.cli; moemesh.cli.build_parser(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
