"""`moemesh check-model` on tiny checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config()
    return write_checkpoint(tmp_path_factory.mktemp("check_model"), config, random_hub_state_dict(config, seed=11))


def test_check_model_json_summary_and_forward(checkpoint, capsys):
    assert main(["check-model", "--model", str(checkpoint), "--json", "--prompt", "The quick brown fox"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [layer["attention"] for layer in summary["layers"]] == ["window", "csa", "hca", "csa"]
    assert [layer["router"] for layer in summary["layers"]] == ["hash", "hash", "learned", "learned"]
    groups = {group["group"]: group for group in summary["groups"]}
    assert groups["routed_expert"]["dtypes"] == ["F8_E8M0", "I8"]
    # 4 layers x 8 experts x 3 matrices of 128 x 128, FP4 + one scale per 32
    assert groups["routed_expert"]["num_params"] == 4 * 8 * 3 * 128 * 128
    assert groups["routed_expert"]["num_bytes"] == 4 * 8 * 3 * (128 * 64 + 128 * 4)
    data_bytes = (checkpoint / "model.safetensors").stat().st_size
    assert summary["total_bytes"] < data_bytes < summary["total_bytes"] + 100_000  # + JSON header
    assert summary["num_missing"] == summary["num_unexpected"] == summary["num_mismatched"] == 0
    forward = summary["forward"]
    assert forward["finite"] and forward["num_tokens"] == len("The quick brown fox")
    assert len(forward["top_token_ids"]) == 5


def test_check_model_reports_missing_tensor(checkpoint, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoint / "config.json").read_text())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["layers.3.ffn.experts.5.w2.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    assert main(["check-model", "--model", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "missing: 1" in out and "layers.3.ffn.experts.5.w2.weight" in out
    assert "forward:" not in out  # no forward on an incomplete checkpoint


def test_check_model_module_does_not_import_torch():
    code = "import sys, moemesh.commands.check_model, moemesh.common.placement.worker_sizes; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
