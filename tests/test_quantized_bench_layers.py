"""`moemesh bench layers` end to end at tiny width on CPU, and the random-state helpers it uses."""

from __future__ import annotations

import json

import torch

from moemesh.bench import layers_floors as floors
from moemesh.bench.layers import main
from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.config import AttentionKind
from moemesh.common.model.random_init import fill_random_context, new_sequence_state, random_model, tiny_flash_like_config
from moemesh.common.model.reference import ReferenceModel


def test_bench_layers_tiny_writes_every_figure(tmp_path):
    code = main(["--tiny", "--layers", "csa,hca", "--batch", "1,3", "--context", "40", "--prefill", "24",
                 "--steps", "2", "--prefill-reps", "1", "--no-transformers", "--out-dir", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("layers-*.json")
    record = json.loads(path.read_text())
    raw, ratios = record["raw"], record["ratios"]
    assert raw["ceilings"]["copy_bytes_per_s"] > 0
    assert [d["batch_size"] for d in ratios["decode"]] == [1, 3]
    for d in ratios["decode"]:
        assert len(d["layer_ratio"]) == 2 and all(r > 0 for r in d["layer_ratio"])
        assert d["model43_tok_s"] > 0 and d["stand_ins"]["window"] == "hca"
    assert ratios["decode"][1]["step_bytes"] > ratios["decode"][0]["step_bytes"]  # more experts at b=3
    b1, b3 = raw["decode"]
    config = tiny_flash_like_config([AttentionKind.CSA, AttentionKind.HCA])
    assert b1["distinct_experts_per_layer"] == [config.num_experts_per_tok] * 2
    assert all(config.num_experts_per_tok <= n <= min(config.n_routed_experts, 3 * config.num_experts_per_tok)
               for n in b3["distinct_experts_per_layer"])
    assert ratios["decode"][1]["distinct_experts_per_layer"] == b3["distinct_experts_per_layer"]
    assert ratios["prefill"][0]["num_tokens"] == 24 and ratios["prefill"][0]["fraction_of_bf16"] > 0
    assert set(ratios["goals"]) >= {"decode_b1_layer_ratio", "single_stream_tok_s", "prefill_tok_s"}


def test_bench_layers_reads_every_layer_of_a_checkpoint(tmp_path):
    """`--checkpoint`: the layers come from a checkpoint on disk through the serving loaders, quantized."""
    from moemesh.bench.random_checkpoint import hub_config, write_random_checkpoint

    hub = hub_config("tiny", num_layers=4, num_mtp_layers=0)
    write_random_checkpoint(tmp_path / "ckpt", hub, seed=3, progress=None, workers=1)
    code = main(["--checkpoint", str(tmp_path / "ckpt"), "--batch", "2", "--context", "40", "--prefill", "",
                 "--steps", "2", "--no-transformers", "--out-dir", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("layers-*.json")
    record = json.loads(path.read_text())
    raw, ratios = record["raw"], record["ratios"]
    assert raw["config"]["checkpoint"] == str(tmp_path / "ckpt")
    assert raw["config"]["layers"] == ["window", "window", "csa", "hca"]
    (decode,) = ratios["decode"]
    assert len(decode["layer_ratio"]) == 4 and all(r > 0 for r in decode["layer_ratio"])
    assert all(b > 0 for b in raw["bytes"]["layer_weight_bytes"]) and raw["bytes"]["expert_bytes"] > 0


def test_flash_floors_match_the_spec():
    """docs/model.md §8: expected distinct experts at b=64 ≈ 199.9; per-token layer matmul params."""
    from moemesh.common.model.random_init import flash_config

    config = flash_config([AttentionKind.CSA, AttentionKind.HCA])
    assert abs(floors.expected_distinct_experts(config, 64) - 199.9) < 0.1
    assert abs(floors.expected_distinct_experts(config, 1) - 6.0) < 1e-9
    attention_and_experts = floors.matmul_params_per_token(config, 1)
    assert 107e6 + 4.3e6 + 176e6 < attention_and_experts < 107e6 + 4.3e6 + 176e6 + 3e6


def test_every_layer_byte_has_one_decode_kernel():
    """The per-kernel floors of `bench layers` split the layer's floor bytes without gaps or overlaps: over
    the kernels, weights + routed experts + KV rows + mHC streams, for every layer kind."""
    config = tiny_flash_like_config([AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA])
    side, experts = random_model(config, "cpu", seed=3)
    expert_bytes, context, batch = experts.bytes_per_expert(0), 300, 3
    for layer in range(3):
        read = floors.kernel_read_bytes(side, config, layer, batch, context, 2, expert_bytes, 2)
        streams = 2 * 2 * batch * config.hc_mult * config.hidden_size * 2  # hc_post and hc_finish, two sites
        want = (floors.layer_weight_bytes(side, layer) + floors.expected_distinct_experts(config, batch) * expert_bytes
                + batch * floors.kv_bytes_per_sequence(config, layer, context, 2) + streams)
        assert abs(sum(read.values()) - want) < 1e-6 * want, (layer, read)
        assert read["_fp8_linear_kernel"] > 0 and read["_grouped_kernel"] > expert_bytes
        assert ("_indexer_scores_topk_kernel" in read) == (config.layer_types[layer] is AttentionKind.CSA)


def test_kernel_floors_pair_profiled_kernels_with_their_bytes():
    from moemesh.bench.layers_report import kernel_floors

    entry = {"kernels_per_piece": {"layer0": {"top": [["_grouped_kernel", 82.0, 3.0], ["_cos_sin_kernel", 1.0, 1.0]]}},
             "kernel_read_bytes_per_layer": [{"_grouped_kernel": 41e6, "_gate_kernel": 2e6}]}
    (rows,) = kernel_floors(entry, 1, copy_bytes_per_s=4.1e12)
    assert rows["_grouped_kernel"] == {"device_us": 82.0, "launches": 3.0, "floor_us": 10.0, "x_floor": 8.2}
    assert rows["_cos_sin_kernel"]["x_floor"] is None and rows["_gate_kernel"]["device_us"] is None
    assert kernel_floors({"kernels_per_piece": None}, 1, 4e12) is None


def test_kernel_floors_of_a_result_file_without_byte_counts():
    """`bench.layers_kernel_floors`: a result that holds only the kernel profile gets its per-kernel floors from
    the byte counts of the same layers built on the CPU."""
    from moemesh.bench.layers_kernel_floors import kernel_floor_rows

    top = [["_grouped_kernel", 50.0, 3.0], ["_fp8_linear_kernel", 40.0, 7.0]]
    entry = {"batch_size": 2, "context_tokens": 64, "kernels_per_piece": {"layer0": {"top": top}, "layer1": {"top": top}}}
    record = {"raw": {"config": {"layers": ["csa", "hca"], "tiny": True, "dtype": "float32"},
                      "ceilings": {"copy_bytes_per_s": 1e9}, "bytes": {"expert_bytes": 1000},
                      "decode": [entry, {"batch_size": 1, "context_tokens": 64, "kernels_per_piece": None}]}}
    with_profile, without = kernel_floor_rows(record)
    assert without["layers"] is None and with_profile["batch_size"] == 2
    csa, hca = with_profile["layers"]
    assert csa["_grouped_kernel"]["device_us"] == 50.0 and csa["_grouped_kernel"]["floor_us"] > 0
    assert "_indexer_scores_topk_kernel" in csa and "_indexer_scores_topk_kernel" not in hca
    ratio = csa["_fp8_linear_kernel"]["device_us"] / csa["_fp8_linear_kernel"]["floor_us"]
    assert abs(csa["_fp8_linear_kernel"]["x_floor"] - ratio) < 1e-9


def test_random_context_then_decode_continues_the_state():
    config = tiny_flash_like_config([AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA])
    side, experts = random_model(config, "cpu", seed=2)
    state = new_sequence_state(config, 200, torch.float32, "cpu")
    fill_random_context(state, 101, generator=torch.Generator().manual_seed(0))
    assert state.num_tokens == 101
    assert state.layers[1].compressor.num_rows == 101 // config.csa_compress_ratio
    assert state.layers[2].compressor.read_rows().shape == (101 // config.hca_compress_ratio, config.head_dim)
    model = ReferenceModel(side, experts)
    before = state.layers[1].indexer.read_rows().clone()
    logits = model.forward(torch.tensor([5, 6, 7]), [SequenceChunk(state, 3)])
    assert torch.isfinite(logits).all() and state.num_tokens == 104
    assert state.layers[1].compressor.num_rows == 26
    assert torch.equal(state.layers[1].indexer.read_rows()[:25], before)
