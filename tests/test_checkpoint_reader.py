"""CheckpointReader: lazy loading, progress, and errors naming the offending tensor or key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moemesh.common.checkpoint.errors import CheckpointError
from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.model.config import ConfigError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config()
    state = random_hub_state_dict(config, seed=3)
    path = write_checkpoint(tmp_path_factory.mktemp("reader_hub"), config, state, max_shard_bytes=300_000)
    return config, path


def _copy_with(tmp_path, source, edit) -> CheckpointReader:
    """Copy a checkpoint, apply `edit(tensors)` to the shard dict of each file, reopen."""
    target = tmp_path / "edited"
    shutil.copytree(source, target)
    for shard in target.glob("*.safetensors"):
        tensors = load_file(str(shard))
        edit(tensors)
        save_file(tensors, str(shard))
    return CheckpointReader(target)


def test_expert_loader_reads_only_those_experts(checkpoint):
    config, path = checkpoint
    reader = CheckpointReader(path)
    assert reader.num_entries_read == 0  # opening reads headers only
    experts = reader.load_experts(config, [(1, 3), (2, 7)])
    assert sorted(reader.read_entry_names) == sorted(
        f"layers.{layer}.ffn.experts.{expert}.{which}.{kind}"
        for layer, expert in [(1, 3), (2, 7)] for which in ("w1", "w2", "w3") for kind in ("weight", "scale")
    )
    w1, w2, w3 = experts[(2, 7)]
    assert w1.shape == w3.shape == (128, 128) and w2.shape == (128, 128)


def test_attention_loader_never_reads_routed_experts_or_mtp(checkpoint):
    config, path = checkpoint
    progress = []
    reader = CheckpointReader(path, on_progress=lambda num_bytes, num_tensors: progress.append((num_bytes, num_tensors)))
    weights = reader.load_attention_side(config, torch.float32)
    assert reader.read_entry_names
    assert not any(".ffn.experts." in name or name.startswith("mtp.") for name in reader.read_entry_names)
    assert "layers.0.ffn.shared_experts.w1.weight" in weights and "embed.weight" in weights
    assert not any(".ffn.experts." in name for name in weights)
    assert progress[-1] == (reader.num_bytes_read, reader.num_entries_read)
    assert [n for _, n in progress] == list(range(1, len(progress) + 1))


def test_load_mtp_fails_when_absent(checkpoint):
    _, path = checkpoint
    config = tiny_config(num_nextn_predict_layers=1, compress_ratios=[0, 4, 128, 4, 0])
    reader = CheckpointReader(path, config=config)  # missing mtp.* is tolerated at open
    with pytest.raises(CheckpointError, match=r"mtp\.0\..*missing"):
        reader.load_mtp()


def test_mtp_round_trip(tmp_path):
    config = tiny_config(num_nextn_predict_layers=1, compress_ratios=[0, 4, 128, 4, 0])
    state = random_hub_state_dict(config, seed=1)
    reader = CheckpointReader(write_checkpoint(tmp_path / "mtp", config, state))
    mtp = reader.load_mtp()
    assert "mtp.0.e_proj.weight" in mtp and "mtp.0.ffn.experts.7.w2.weight" in mtp
    assert torch.equal(mtp["mtp.0.enorm.weight"], state["mtp.0.enorm.weight"].to(torch.bfloat16).float())
    assert not any(name.startswith("mtp.") for name in reader.load_attention_side())


def test_missing_tensor_is_named(checkpoint, tmp_path):
    _, path = checkpoint
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wkv\.scale: missing \(expected shape \[1, 1\]"):
        _copy_with(tmp_path, path, lambda t: t.pop("layers.2.attn.wkv.scale", None))


def test_wrong_shape_is_named(checkpoint, tmp_path):
    _, path = checkpoint

    def edit(tensors):
        if "layers.1.attn_norm.weight" in tensors:
            tensors["layers.1.attn_norm.weight"] = torch.ones(127, dtype=torch.bfloat16)

    with pytest.raises(CheckpointError, match=r"layers\.1\.attn_norm\.weight: expected shape \[128\] dtype BF16, "
                                              r"found shape \[127\] dtype BF16"):
        _copy_with(tmp_path, path, edit)


def test_wrong_dtype_is_named(checkpoint, tmp_path):
    _, path = checkpoint

    def edit(tensors):
        if "layers.0.attn.attn_sink" in tensors:
            tensors["layers.0.attn.attn_sink"] = tensors["layers.0.attn.attn_sink"].to(torch.bfloat16)

    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.attn_sink: expected shape \[4\] dtype F32, "
                                              r"found shape \[4\] dtype BF16"):
        _copy_with(tmp_path, path, edit)


def test_unknown_config_value_names_the_key(checkpoint, tmp_path):
    _, path = checkpoint
    target = tmp_path / "bad_config"
    shutil.copytree(path, target)
    hub_config = json.loads((target / "config.json").read_text())
    hub_config["compress_ratios"] = [0, 4, 64, 4]
    (target / "config.json").write_text(json.dumps(hub_config))
    with pytest.raises(ConfigError, match=r"compress_ratios\[2\]=64"):
        CheckpointReader(target)
    hub_config["compress_ratios"] = [0, 4, 128, 4]
    hub_config["expert_dtype"] = "int3"
    (target / "config.json").write_text(json.dumps(hub_config))
    with pytest.raises(ConfigError, match=r"expert_dtype='int3'"):
        CheckpointReader(target)


def test_unexpected_tensor_is_reported_not_fatal(checkpoint, tmp_path):
    _, path = checkpoint

    def edit(tensors):
        if "embed.weight" in tensors:
            tensors["layers.0.attn.bogus"] = torch.zeros(2)

    reader = _copy_with(tmp_path, path, edit)
    assert reader.report.unexpected == ["layers.0.attn.bogus"]
    assert reader.report.missing == [] and reader.report.mismatched == []
    with pytest.raises(CheckpointError, match="layers.0.attn.bogus"):
        reader.load("layers.0.attn.bogus")


def test_writer_rejects_missing_and_unknown_names(tmp_path):
    config = tiny_config()
    state = random_hub_state_dict(config, seed=0)
    state.pop("layers.3.attn.wo_b.weight")
    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.wo_b\.weight: missing"):
        write_checkpoint(tmp_path / "a", config, state)
    state = random_hub_state_dict(config, seed=0)
    state["layers.9.attn.wq_a.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"layers\.9\.attn\.wq_a\.weight"):
        write_checkpoint(tmp_path / "b", config, state)
    state = random_hub_state_dict(config, seed=0)
    state["norm.weight"] = torch.zeros(64)
    with pytest.raises(CheckpointError, match=r"norm\.weight: expected shape \[128\], got \[64\]"):
        write_checkpoint(tmp_path / "c", config, state)


def test_transformers_names_and_weight_scale_inv(checkpoint, tmp_path):
    _, path = checkpoint
    reader = CheckpointReader(path)
    assert torch.equal(reader.load("model.layers.0.self_attn.q_a_proj.weight"), reader.load("layers.0.attn.wq_a.weight"))
    assert torch.equal(reader.load("model.layers.0.self_attn.q_a_proj.weight_scale_inv"),
                       reader.load("layers.0.attn.wq_a.scale"))
    raw = reader.load_quantized("layers.1.ffn.experts.2.w3.weight")
    assert (raw.weight.dtype, tuple(raw.weight.shape)) == (torch.int8, (128, 64))
    assert (raw.scale.dtype, tuple(raw.scale.shape), raw.block_size) == (torch.float8_e8m0fnu, (128, 4), (1, 32))

    def rename_scales(tensors):  # V3-style scale names
        for name in [n for n in tensors if n.endswith(".scale")]:
            tensors[name.removesuffix(".scale") + ".weight_scale_inv"] = tensors.pop(name)

    renamed = _copy_with(tmp_path, path, rename_scales)
    assert renamed.report.ok
    assert torch.equal(renamed.load("layers.2.attn.wo_a.weight"), reader.load("layers.2.attn.wo_a.weight"))
    assert torch.equal(renamed.load_experts(None, [(0, 4)])[(0, 4)][0], reader.load_experts(None, [(0, 4)])[(0, 4)][0])


def test_dspark_stages_round_trip(tmp_path):
    config = tiny_config(num_nextn_predict_layers=3, compress_ratios=[0, 4, 128, 4, 0, 0, 0], dspark_block_size=5,
                         dspark_markov_rank=32, dspark_target_layer_ids=[1, 2, 3], dspark_noise_token_id=255)
    state = random_hub_state_dict(config, seed=2)
    reader = CheckpointReader(write_checkpoint(tmp_path / "dspark", config, state))
    assert reader.config.dspark == config.dspark
    mtp = reader.load_mtp()
    assert mtp["mtp.0.main_proj.weight"].shape == (128, 384)
    assert reader.found_dtype("mtp.0.main_proj.scale") == "F8_E8M0"
    assert torch.equal(mtp["mtp.2.markov_head.markov_w1.weight"],
                       state["mtp.2.markov_head.markov_w1.weight"].to(torch.bfloat16).float())
    assert mtp["mtp.2.confidence_head.proj.weight"].shape == (1, 160)
    assert {name.split(".")[1] for name in mtp} == {"0", "1", "2"}
