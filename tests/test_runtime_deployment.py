"""Deployment TOML: parsing, overrides, endpoint derivation, and errors that name the key."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import structlog

from moemesh.common.runtime.deployment import (
    Deployment, DeploymentError, ExpertWorkerConfig, KVConfig, ModelConfig, PathsConfig, TimeoutsConfig,
    AttentionWorkerConfig, DraftWorkerConfig, add_deployment_arguments, derive_endpoints, load_deployment,
    SchedulingConfig, parse_deployment,
)
from moemesh.common.runtime.deployment_writer import format_deployment, write_deployment_file
from moemesh.common.runtime.logging import bound_request, configure_logging

EXAMPLE = """
[model]
path = "models/tiny"

[paths]
run_dir = "{run_dir}"

[timeouts]
dispatch_s = 2
heartbeat_interval_s = 0.5

[[attention]]
name = "attention-0"
device = "cuda:0"

[[expert]]
name = "expert-0"
device = "cuda:0"

[[expert]]
name = "expert-1"
device = "cpu"
placement = "placements/cpu.csv"

[draft]
enabled = true
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deployment.toml"
    path.write_text(text)
    return path


def test_example_parses_with_defaults_and_overrides(tmp_path):
    path = _write(tmp_path, EXAMPLE.format(run_dir=tmp_path / "run"))
    deployment = load_deployment(path, ["attention.device=cuda:1", "expert[1].device=cuda:2", "router.port=9000"])
    assert deployment.model.dtype == "auto"
    assert deployment.timeouts.dispatch_s == 2.0 and isinstance(deployment.timeouts.dispatch_s, float)
    assert deployment.attention[0].device == "cuda:1"
    assert [worker.device for worker in deployment.expert] == ["cuda:0", "cuda:2"]
    assert deployment.expert[1].placement == "placements/cpu.csv"
    assert deployment.router.port == 9000
    endpoints = derive_endpoints(deployment)
    assert endpoints.supervisor == f"ipc://{tmp_path}/run/supervisor.sock"
    assert endpoints.expert["expert-1"] == f"ipc://{tmp_path}/run/expert-1.sock"
    assert endpoints.draft == f"ipc://{tmp_path}/run/draft.sock"
    with pytest.raises(AttributeError):
        deployment.router.port = 1  # frozen


def test_hosts_switch_every_endpoint_to_tcp():
    raw = {"model": {"path": "m"}, "network": {"base_port": 7000},
           "attention": [{"name": "a", "host": "10.0.0.2"}], "expert": [{"name": "e"}]}
    endpoints = derive_endpoints(parse_deployment(raw))
    assert endpoints.supervisor == "tcp://127.0.0.1:7000"
    assert endpoints.attention == {"a": "tcp://10.0.0.2:7001"}
    assert endpoints.expert == {"e": "tcp://127.0.0.1:7002"} and endpoints.draft is None


@pytest.mark.parametrize(
    "edit, overrides, key",
    [
        (("device = \"cpu\"", "device = 3"), [], "expert[1].device"),
        (("[draft]", "[draft]\ncolour = 1"), [], "draft.colour"),
        (("dispatch_s = 2", "dispatch_s = \"slow\""), [], "timeouts.dispatch_s"),
        (("path = \"models/tiny\"", ""), [], "model.path"),
        (("", ""), ["expert.device=cpu"], "expert"),
        (("", ""), ["expert[5].device=cpu"], "expert[5]"),
        (("", ""), ["router.port=eighty"], "router.port"),
        (("", ""), ["attention[0].gpu=1"], "attention[0].gpu"),
        (("name = \"expert-1\"", "name = \"expert-0\""), [], "expert[1].name"),
        (("", ""), ["scheduler.shared_prefill_token_threshold=0"], "scheduler.shared_prefill_token_threshold"),
        (("", ""), ["scheduler.short_request_window_s=-1"], "scheduler.short_request_window_s"),
        (("", ""), ["scheduler.graph_prefill_token_threshold=-1"], "scheduler.graph_prefill_token_threshold"),
        (("", ""), ["kv.num_primary_snapshots=-1"], "kv.num_primary_snapshots"),
    ],
)
def test_errors_name_the_bad_key(tmp_path, edit, overrides, key):
    text = EXAMPLE.format(run_dir=tmp_path).replace(*edit) if edit[0] else EXAMPLE.format(run_dir=tmp_path)
    with pytest.raises(DeploymentError) as error:
        load_deployment(_write(tmp_path, text), overrides)
    assert str(error.value).startswith(key)


def test_unreadable_and_invalid_toml_are_reported(tmp_path):
    with pytest.raises(DeploymentError, match="cannot read"):
        load_deployment(tmp_path / "missing.toml")
    with pytest.raises(DeploymentError, match="not valid TOML"):
        load_deployment(_write(tmp_path, "[model\npath="))


def test_cli_arguments(tmp_path):
    parser = argparse.ArgumentParser()
    add_deployment_arguments(parser)
    args = parser.parse_args(["--config", "x.toml", "--set", "a.b=1", "--set", "c=d"])
    assert args.config == "x.toml" and args.overrides == ["a.b=1", "c=d"]


def test_logging_writes_json_with_service_pid_and_bound_request(tmp_path, capsys):
    log_path = configure_logging("unit", tmp_path / "logs", "info")
    try:
        log = structlog.get_logger()
        log.debug("unit.hidden")  # below the level
        with bound_request(request_id="req-1", step_id=4):
            log.info("unit.step_done", num_tokens=3)
        log.info("unit.after")
        lines = [json.loads(line) for line in log_path.read_text().splitlines()]
        assert [line["event"] for line in lines] == ["unit.step_done", "unit.after"]
        assert lines[0]["request_id"] == "req-1" and lines[0]["step_id"] == 4 and lines[0]["num_tokens"] == 3
        assert "request_id" not in lines[1]
        assert all(line["service"] == "unit" and line["pid"] > 0 and line["level"] == "info" for line in lines)
        assert "unit.step_done" in capsys.readouterr().err
        with pytest.raises(ValueError, match="log level"):
            configure_logging("unit", None, "loud")
    finally:
        structlog.reset_defaults()


def test_written_deployment_loads_back_equal(tmp_path):
    deployment = Deployment(
        model=ModelConfig(path='models/a "quoted" \\ path', dtype="bfloat16"),
        attention=(AttentionWorkerConfig("attention-0", device="cuda:0", cuda_graphs=True),),
        expert=(ExpertWorkerConfig("expert-0", device="cuda:0", memory_limit="40GiB"),
                ExpertWorkerConfig("expert-1", placement=str(tmp_path / "placement.toml"), expert_dtype="fp8")),
        paths=PathsConfig(run_dir=str(tmp_path), log_dir=str(tmp_path / "logs")),
        timeouts=TimeoutsConfig(dispatch_s=2.5, step_s=60.0),
        kv=KVConfig(num_primary_blocks=64, num_cpu_blocks=0, prefix_caching=False, num_primary_snapshots=32,
                    num_cpu_snapshots=0),
        draft=DraftWorkerConfig(enabled=True, device="cuda:1"),
        scheduler=SchedulingConfig(shared_prefill_token_threshold=512, short_request_window_s=0.5,
                                   graph_prefill_token_threshold=0),
    )
    path = write_deployment_file(tmp_path / "deployment.toml", deployment)
    assert load_deployment(path) == deployment
    table = {"model": {"path": "m", "flag": True, "n": 2}, "expert": [{"name": "e", "ids": [1, 2]}]}
    import tomllib

    assert tomllib.loads(format_deployment(table)) == table
    with pytest.raises(TypeError):
        format_deployment({"model": {"bad": None}})


def test_short_prefills_follow_the_attention_workers_graphs():
    """The router sizes short prefills to the graphs' chunk only when every attention worker replays them."""
    from moemesh.services.router.main import graph_chunk_tokens

    def deployment(*workers):
        return Deployment(model=ModelConfig(path="m"), attention=workers, expert=(ExpertWorkerConfig("expert-0"),))

    assert graph_chunk_tokens(deployment(AttentionWorkerConfig("a", device="cuda:0", cuda_graphs=True))) == 8
    assert graph_chunk_tokens(deployment(AttentionWorkerConfig("a", device="cuda:0"))) == 0
    assert graph_chunk_tokens(deployment(AttentionWorkerConfig("a", device="cpu", cuda_graphs=True))) == 0
    assert graph_chunk_tokens(deployment(AttentionWorkerConfig("a", device="cuda:0", cuda_graphs=True),
                                         AttentionWorkerConfig("b", device="cuda:1"))) == 0
