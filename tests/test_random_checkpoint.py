"""`moemesh bench make-checkpoint` (bench/random_checkpoint.py): the directory it writes is a hub-format
checkpoint like the released one. At tiny width (6 layers: window, CSA and HCA attention, hash and
learned routing, FP8 linears, FP4 experts, the three DSpark stages): headers and dtypes per stored format,
no NaN codes; transformers 5.23.0 loads it and gives the logits of moemesh's single-process forward;
`moemesh check-model` passes it; a routing skew concentrates the learned layers' expert choices on the
low-rank experts; the draft worker's loader builds the drafter from its `mtp.*` stages; the bytes do not
depend on sharding or worker processes; a cached directory is reused. At V4-Flash width nothing is
written: the planned entries are checked against the byte counts of the model specification."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moemesh.bench.random_checkpoint import (
    cached_checkpoint, dspark_hub_keys, hub_config, skew_ranks, with_dspark, write_random_checkpoint,
)
from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.model.config import ModelConfig, RouterKind

LAYERS = 6  # hash-routed 0-2, learned 3-5; window 0-1, CSA 2 and 4, HCA 3 and 5
SKEW = 2.0


def _make(out: Path, *extra: str) -> Path:
    from moemesh.cli import main

    argv = ["bench", "make-checkpoint", "--preset", "tiny", "--layers", str(LAYERS), "--seed", "3", *extra,
            "--out", str(out)]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("ckpt") / "plain", "--dspark")


@pytest.fixture(scope="module")
def skewed(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("ckpt") / "skewed", "--dspark", "--routing-skew", str(SKEW))


def _load_ours(path: Path):
    from moemesh.commands.generate import _load_model

    model, config = _load_model(str(path), "float32", "cpu")
    return model, config


def _tokens(config, num_tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(2, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ the files
def test_directory_is_a_hub_checkpoint(plain):
    files = sorted(p.name for p in plain.iterdir())
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                 "tokenizer_config.json", "model-00001-of-00001.safetensors"):
        assert name in files
    hub = json.loads((plain / "config.json").read_text())
    assert hub["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert hub["expert_dtype"] == "fp4" and hub["architectures"] == ["DeepseekV4ForCausalLM"]
    assert hub["compress_ratios"] == [0, 0, 4, 128, 4, 128, 0, 0, 0]  # 6 main layers + 3 DSpark stages
    assert hub["dspark_target_layer_ids"] == [3, 4, 5] and hub["num_nextn_predict_layers"] == 3
    reader = CheckpointReader(plain)
    assert reader.report.ok  # every inventory entry (mtp.* included) with its shape and dtype, nothing else
    index = json.loads((plain / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(reader.tensor_names())
    dtype = reader.found_dtype
    assert dtype("layers.3.attn.wq_b.weight") == "F8_E4M3" and dtype("layers.3.attn.wq_b.scale") == "F8_E8M0"
    assert dtype("layers.3.ffn.experts.7.w2.weight") == "I8" and dtype("layers.3.ffn.experts.7.w2.scale") == "F8_E8M0"
    assert dtype("layers.0.ffn.gate.tid2eid") == "I64" and dtype("layers.3.ffn.gate.bias") == "F32"
    assert dtype("embed.weight") == "BF16" and dtype("layers.2.attn.compressor.ape") == "F32"
    for name in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.markov_head.markov_w1.weight",
                 "mtp.2.confidence_head.proj.weight", "mtp.1.ffn.experts.0.w1.weight", "mtp.2.hc_head_fn"):
        assert dtype(name) is not None, name
    assert dtype("mtp.0.main_proj.weight") == "F8_E4M3" and dtype("mtp.1.ffn.experts.0.w1.weight") == "I8"


def test_quantized_bytes_are_valid_codes_with_sane_scales(plain):
    reader = CheckpointReader(plain)
    for name in reader.tensor_names():
        raw = reader._read_entry(name)
        if raw.dtype == torch.float8_e4m3fn:
            codes = raw.view(torch.uint8)
            assert not ((codes & 0x7F) == 0x7F).any(), f"{name}: NaN e4m3 code"
        elif raw.dtype == torch.float8_e8m0fnu:
            exponents = raw.view(torch.uint8).int() - 127
            assert exponents.min() >= -20 and exponents.max() <= 0, name
    for name in ("layers.4.attn.wo_b.weight", "layers.4.ffn.experts.2.w1.weight", "layers.4.ffn.experts.2.w2.weight"):
        weight = reader.load(name)  # dequantised: std near in_features^-1/2
        assert 0.4 < float(weight.std()) * math.sqrt(weight.shape[1]) < 2.5, name
    tid2eid = reader.load("layers.1.ffn.gate.tid2eid")
    assert (tid2eid.sort(dim=1).values.diff(dim=1) != 0).all()  # distinct experts per token


def test_tokenizer_covers_the_vocabulary(plain):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(plain / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    ids = tokenizer.encode("Hello, wörld <｜User｜>").ids
    assert max(ids) < 512 and tokenizer.token_to_id("<｜User｜>") == 3
    assert tokenizer.decode(tokenizer.encode("Hello, wörld").ids).strip() == "Hello, wörld"
    assert tokenizer.decode([511]) != ""  # every id the model can emit decodes


def test_tokenizer_at_the_flash_vocabulary(tmp_path):
    """129,280 ids: the default model's 12,288 tokens, then plain tokens encoding never produces."""
    from tokenizers import Tokenizer

    from moemesh.bench.random_checkpoint import write_tokenizer
    from moemesh.services.router.detokenizer import TokenBytes

    write_tokenizer(tmp_path, 129280)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 129280
    ids = tokenizer.encode("In the beginning <｜Assistant｜>").ids
    assert max(ids) < 12288 and ids[0] == 0  # BOS first, as the default model's tokenizer
    assert tokenizer.decode([129279]) == "<r129279>"
    token_bytes = TokenBytes(tokenizer)  # what the gateway's detokenizer sends for an id
    assert token_bytes.is_byte_level is True and token_bytes(129279) == b"<r129279>"


def test_bytes_do_not_depend_on_sharding(plain, tmp_path):
    hub = json.loads((plain / "config.json").read_text())
    sharded = tmp_path / "sharded"
    report = write_random_checkpoint(sharded, hub, seed=3, max_shard_bytes=400_000, progress=None, workers=1)
    assert report.num_shards > 2
    a, b = CheckpointReader(plain), CheckpointReader(sharded)
    for name in a.tensor_names():
        x, y = a._read_entry(name), b._read_entry(name)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y)
    with pytest.raises(FileExistsError):
        write_random_checkpoint(sharded, hub, progress=None)


def test_cached_checkpoint_is_written_once(tmp_path):
    hub = hub_config("tiny", num_layers=2, num_mtp_layers=0)
    said: list[str] = []
    first = cached_checkpoint(hub, seed=1, cache_dir=tmp_path, progress=said.append)
    assert any(line.startswith("wrote") for line in said)
    said.clear()
    assert cached_checkpoint(hub, seed=1, cache_dir=tmp_path, progress=said.append) == first
    assert said == [f"reusing checkpoint {first}"]
    assert cached_checkpoint(hub, seed=2, cache_dir=tmp_path, progress=None) != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial directory left


def test_too_little_disk_fails_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10_000, 9_000, 1_000))
    with pytest.raises(OSError, match="needs 1.53 MiB of disk, 1000 B is free"):
        cached_checkpoint(with_dspark(hub_config("tiny", num_layers=4)), cache_dir=tmp_path, progress=None)
    assert list(tmp_path.iterdir()) == []  # the partial directory is gone too


# ------------------------------------------------------------------------------------ loading
def test_transformers_gives_moemesh_logits(plain):
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    model, config = _load_ours(plain)
    token_ids = _tokens(config, 40, seed=0)  # > 2x the window of 16, 10 CSA rows, 2 HCA rows
    ours = model.forward_sequence(token_ids)
    hf = DeepseekV4ForCausalLM.from_pretrained(plain, quantization_config=FineGrainedFP8Config(dequantize=True),
                                               attn_implementation="eager").float().eval()
    with torch.no_grad():
        theirs = hf(token_ids[None]).logits[0]
    assert torch.isfinite(ours).all() and ours.abs().max() > 0.5
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_check_model_passes(plain, capsys):
    from moemesh.cli import main

    assert main(["check-model", "--model", str(plain), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_missing"] == summary["num_unexpected"] == summary["num_mismatched"] == 0
    assert summary["forward"]["finite"]


def _expert_counts(model, config, token_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per learned layer: how often each expert was chosen over the tokens of one forward."""
    counts = {layer: torch.zeros(config.n_routed_experts) for layer in range(config.num_hidden_layers)
              if config.mlp_layer_types[layer] is RouterKind.LEARNED}
    inner = model.experts_fn

    def counting(layer, hidden, ids, weights):
        if layer in counts:
            counts[layer] += torch.bincount(ids.flatten(), minlength=config.n_routed_experts).float()
        return inner(layer, hidden, ids, weights)

    model.experts_fn = counting
    with torch.no_grad():
        model.forward_sequence(token_ids)
    model.experts_fn = inner
    return counts


def test_routing_skew_concentrates_expert_choices(plain, skewed):
    """Share of the learned layers' choices that go to the 4 lowest-rank experts (of 16, top-2)."""
    shares = {}
    for name, path in (("plain", plain), ("skewed", skewed)):
        model, config = _load_ours(path)
        counts = _expert_counts(model, config, _tokens(config, 96, seed=1))
        hot = []
        for layer, count in counts.items():
            ranks = torch.tensor(skew_ranks(config.n_routed_experts, layer, seed=3))
            hot.append(float(count[ranks < 4].sum() / count.sum()))
        shares[name] = hot
    assert len(shares["skewed"]) == 3
    assert all(0.1 < share < 0.45 for share in shares["plain"]), shares  # 4 of 16: ~0.25 without skew
    assert all(share > 0.8 for share in shares["skewed"]), shares
    bias = CheckpointReader(skewed).load("layers.4.ffn.gate.bias")
    ranks = torch.tensor(skew_ranks(16, 4, seed=3), dtype=torch.float32)
    torch.testing.assert_close(bias, -SKEW * torch.log1p(ranks))  # the definition, exactly
    stage_bias = CheckpointReader(skewed).load("mtp.1.ffn.gate.bias")  # stage j: ranks of block L + j
    torch.testing.assert_close(stage_bias, -SKEW * torch.log1p(torch.tensor(skew_ranks(16, LAYERS + 1, 3),
                                                                            dtype=torch.float32)))


def test_dspark_stages_load_in_the_drafter(plain):
    from moemesh.common.model.config import NumericsConfig
    from moemesh.common.drafting.proposer import load_drafter

    drafter = load_drafter(str(plain), "cpu", NumericsConfig(dtype="float32"))
    reader = CheckpointReader(plain)
    assert len(drafter.mtp) == 3
    x = torch.randn(3, 3 * drafter.config.hidden_size, generator=torch.Generator().manual_seed(1))
    expected = torch.nn.functional.linear(x, reader.load("mtp.0.main_proj.weight"))  # FP8 stage weight, dequantised
    torch.testing.assert_close(drafter.mtp[0].main_proj(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(drafter.embed.weight.float(), reader.load("embed.weight").float())  # kept as stored
    config = drafter.config
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(12, 3 * config.hidden_size, generator=generator)
    base, hidden = drafter.propose(features, torch.arange(12), seed_token_id=7, seed_position=12)
    assert base.shape == (config.dspark.block_size, config.vocab_size)
    assert torch.isfinite(base).all() and torch.isfinite(hidden).all() and base.std() > 0.01
    chain = drafter.greedy_chain(base, hidden, seed_token_id=7)
    assert len(chain.token_ids) == config.dspark.block_size


# ------------------------------------------------------------------------------------ full width
def test_flash_entries_match_the_specification():
    """V4-Flash + DSpark at true width, planned but not written: shapes, dtypes and bytes per kind
    from docs/model.md / docs/speculation.md, not from the code."""
    from moemesh.bench.random_checkpoint_tensors import checkpoint_entries

    hub = hub_config("v4-flash", dspark=True)
    config = ModelConfig.from_dict(hub)
    assert len(hub["compress_ratios"]) == 46 and hub["dspark_noise_token_id"] == 128799
    entries = {e.name: e for e in checkpoint_entries(config, 0.0)}
    D, inter, experts = 4096, 2048, 256
    w1 = entries["layers.10.ffn.experts.255.w1.weight"]
    assert (w1.dtype, w1.shape) == ("I8", (inter, D // 2))
    assert entries["layers.10.ffn.experts.255.w1.scale"].shape == (inter, D // 32)
    assert entries["layers.10.ffn.experts.255.w2.scale"].shape == (D, inter // 32)
    wq_b_scale = entries["layers.10.attn.wq_b.scale"]
    assert (wq_b_scale.dtype, wq_b_scale.shape) == ("F8_E8M0", (256, 8))
    expert_bytes = 3 * (inter * D // 2 + inter * D // 32)
    assert round(expert_bytes / 1e6, 2) == 13.37  # docs/model.md §8: one routed expert 13.37 MB
    routed = sum(e.num_bytes for name, e in entries.items() if ".ffn.experts." in name)
    assert routed == (43 + 3) * experts * expert_bytes
    assert entries["mtp.0.main_proj.weight"].shape == (D, 3 * D)
    assert entries["mtp.2.markov_head.markov_w1.weight"].shape == (129280, 256)
    assert entries["layers.0.ffn.gate.tid2eid"].shape == (129280, 6) and "layers.3.ffn.gate.tid2eid" not in entries
    main_bytes = sum(e.num_bytes for name, e in entries.items() if not name.startswith("mtp."))
    assert round(main_bytes / 1e9, 2) == 156.02  # docs/model.md §8: main model 156.02 GB
    released = checkpoint_entries(ModelConfig.from_dict(hub_config("v4-flash")), 0.0)  # with its one plain MTP block
    assert round(sum(e.num_bytes for e in released) / 1e9, 2) == 159.61  # the whole released checkpoint


def test_dspark_keys_adapt_to_depth():
    assert dspark_hub_keys(43) == {"dspark_block_size": 5, "dspark_markov_rank": 256,
                                   "dspark_target_layer_ids": [40, 41, 42], "dspark_noise_token_id": 128799,
                                   "num_nextn_predict_layers": 3}
    assert dspark_hub_keys(4, vocab_size=512)["dspark_noise_token_id"] == 511
    with pytest.raises(ValueError):
        dspark_hub_keys(2)
    assert with_dspark(hub_config("tiny", num_layers=4))["compress_ratios"] == [0, 0, 4, 128, 0, 0, 0]


def test_bad_arguments_fail_naming_the_key(tmp_path, capsys):
    from moemesh.cli import main

    assert main(["bench", "make-checkpoint", "--preset", "tiny", "--set", "o_groups=3",
                 "--out", str(tmp_path / "x")]) == 2
    assert "o_groups=3" in capsys.readouterr().err
    assert main(["bench", "make-checkpoint", "--preset", "tiny", "--layers", "99", "--out", str(tmp_path / "y")]) == 2
    assert not (tmp_path / "x").exists()
