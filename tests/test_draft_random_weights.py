"""The DSpark drafter from a random model directory (services/draft/random_weights.py): hub keys,
V4-Flash byte accounting against dspark.md / dsv4-model.md numbers, a tiny drafter's proposals, the
shared embed/head equal to the attention side's, the draft worker (in process and as a service
process) loading a random directory, and the CUDA build (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import math
import signal
from pathlib import Path

import pytest
import torch

from common.model.config import AttentionKind, ModelConfig, NumericsConfig
from common.model.quantized import Fp8Linear, QuantizedRoutedExperts
from common.wire import messages as m
from services.draft.random_weights import (
    build_random_drafter, drafter_weight_bytes, dspark_hub_keys, meta_drafter, target_embed_head, with_dspark,
)
from services.draft.worker import DraftWorker, DraftWorkerConfig, load_drafter
from services.expert.random_weights import RandomWeightsSpec, write_random_model

LAYERS = [AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA, AttentionKind.CSA]
FP32 = NumericsConfig(dtype="float32")


def _tiny_hub(kernel_friendly: bool = False) -> dict:
    from common.model.random_init import tiny_flash_like_config

    return with_dspark(tiny_flash_like_config(LAYERS, kernel_friendly=kernel_friendly).to_hub_dict())


def _model_dir(tmp_path: Path, seed: int, kernel_friendly: bool = False, name: str = "model") -> Path:
    return write_random_model(tmp_path / name, _tiny_hub(kernel_friendly), RandomWeightsSpec(seed=seed))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("draft-random"), seed=5)


@pytest.fixture(scope="module")
def tiny_drafter(tiny_dir):
    return load_drafter(str(tiny_dir), "cpu", FP32)


def _context(config: ModelConfig, num_positions: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(num_positions, 3 * config.hidden_size, generator=generator)  # [C, F]
    return features, torch.arange(num_positions)


# ------------------------------------------------------------------------------------ config keys
def test_hub_keys_are_the_flash_drafter_adapted_to_depth():
    keys = dspark_hub_keys(43)
    assert keys == {"dspark_block_size": 5, "dspark_markov_rank": 256, "dspark_target_layer_ids": [40, 41, 42],
                    "dspark_noise_token_id": 128799, "num_nextn_predict_layers": 3}
    small = dspark_hub_keys(4, vocab_size=512)
    assert small["dspark_target_layer_ids"] == [1, 2, 3] and small["dspark_noise_token_id"] == 511
    assert dspark_hub_keys(8, vocab_size=129280)["dspark_noise_token_id"] == 128799
    with pytest.raises(ValueError):
        dspark_hub_keys(2)


def test_flash_config_validates_and_has_46_compress_ratios():
    from common.placement.presets import v4_flash_hub_dict

    hub = with_dspark(v4_flash_hub_dict())
    assert len(hub["compress_ratios"]) == 46 and hub["compress_ratios"][43:] == [0, 0, 0]
    config = ModelConfig.from_dict(hub)
    assert config.num_hidden_layers == 43 and config.num_nextn_predict_layers == 3
    assert config.dspark.target_layer_ids == (40, 41, 42) and config.dspark.block_size == 5
    assert ModelConfig.from_dict(config.to_hub_dict()) == config  # round trip keeps the drafter keys


def test_flash_drafter_bytes_match_the_spec():
    """Counted from the specs' shapes (dsv4-model.md §4.2-4.3, dspark.md §3.1), not from the code."""
    from common.placement.presets import v4_flash_hub_dict

    drafter = meta_drafter(ModelConfig.from_dict(with_dspark(v4_flash_hub_dict())))  # no weights built
    D, q_rank, heads, head_dim, groups, o_rank = 4096, 1024, 64, 512, 8, 1024
    inter, num_experts, vocab, rank, num_stages = 2048, 256, 129280, 256, 3

    def fp8(rows: int, cols: int) -> int:  # e4m3 bytes + one ue8m0 byte per 128x128 block
        return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128)

    stage_fp8 = (fp8(q_rank, D) + fp8(heads * head_dim, q_rank) + fp8(head_dim, D)
                 + fp8(groups * o_rank, heads * head_dim // groups) + fp8(D, groups * o_rank)
                 + 2 * fp8(inter, D) + fp8(D, inter))  # wq_a, wq_b, wkv, wo_a, wo_b, shared w1/w3, w2
    expected_fp8 = num_stages * stage_fp8 + fp8(D, 3 * D)  # + mtp.0.main_proj [4096, 12288]
    expert_bytes = 3 * (inter * D // 2 + inter * D // 32)  # FP4 e2m1 packed + one ue8m0 per 32
    assert round(expert_bytes / 1e6, 2) == 13.37  # dsv4-model.md §8: one routed expert 13.37 MB

    sizes = drafter_weight_bytes(drafter)
    assert sizes.fp8_linear_bytes == expected_fp8
    assert sizes.routed_expert_bytes == num_stages * num_experts * expert_bytes
    assert 10.0e9 < sizes.routed_expert_bytes < 10.5e9  # "~10 GB FP4"

    mix, width = (2 + 4) * 4, 4 * D
    f32 = num_stages * (2 * (mix * width + mix + 3) + heads + num_experts) + (4 * width + 4 + 1)  # mHC, sink, bias
    norms = num_stages * (2 * D + q_rank + head_dim) + D + D  # per stage 4 norms; main_norm; last norm
    bf16 = num_stages * num_experts * D + 2 * vocab * rank + (D + rank)  # gates; Markov W1, W2; confidence
    assert sum(p.numel() for p in drafter.parameters()) == f32 + norms + bf16
    assert sizes.other_bytes == 4 * (f32 + norms) + 2 * bf16  # norms kept fp32 at runtime (spec notation)
    assert sizes.shared_bytes == 2 * 2 * vocab * D  # the target's embed + head, bf16
    # nothing the drafter owns is a dense float copy of a quantized weight
    assert all(isinstance(block.attn.wq_b, Fp8Linear) for block in drafter.mtp)
    assert isinstance(drafter.mtp[0].main_proj, Fp8Linear) and isinstance(drafter.experts_fn, QuantizedRoutedExperts)


# ------------------------------------------------------------------------------------ tiny drafter
def test_tiny_random_drafter_proposals_are_valid(tiny_drafter):
    drafter = tiny_drafter
    config = drafter.config
    assert isinstance(drafter.mtp[1].attn.wkv, Fp8Linear) and isinstance(drafter.experts_fn, QuantizedRoutedExperts)
    assert sorted({layer for layer, _ in drafter.experts_fn.pairs}) == [0, 1, 2]
    features, positions = _context(config, 16)
    base, hidden = drafter.propose(features, positions, seed_token_id=7, seed_position=16)
    assert base.shape == (5, config.vocab_size) and hidden.shape == (5, config.hidden_size)
    assert base.dtype == torch.float32 and torch.isfinite(base).all() and base.std() > 0.1

    greedy = drafter.greedy_chain(base, hidden, seed_token_id=7)
    assert greedy.token_ids.shape == (5,) and ((0 <= greedy.token_ids) & (greedy.token_ids < config.vocab_size)).all()
    torch.testing.assert_close(greedy.probs.sum(dim=-1), torch.ones(5), atol=1e-5, rtol=0)
    assert ((greedy.confidences > 0) & (greedy.confidences < 1)).all()
    assert torch.equal(greedy.token_ids, greedy.probs.argmax(dim=-1))  # temperature 1: argmax of its own softmax

    sampled = drafter.sampled_chain(base, hidden, 7, temperature=1.0, seed=3, output_positions=range(5))
    chosen = sampled.probs.gather(1, sampled.token_ids[:, None]).squeeze(1)
    assert (chosen > 0).all()  # every sampled token is in its distribution's support
    torch.testing.assert_close(sampled.probs.sum(dim=-1), torch.ones(5), atol=1e-5, rtol=0)


def test_random_drafter_equals_the_checkpoint_path_on_its_dequantised_values(tiny_drafter):
    """The quantized random drafter computes what the checkpoint loader's dense drafter
    (`DSparkDrafter.from_state_dict`, float32) computes on the dequantised FP8/FP4 values."""
    from common.model.dspark import DSparkDrafter
    from common.model.quantized import dequantized_expert_weights

    drafter = tiny_drafter
    hub_sd = {}
    for name, module in drafter.named_modules():
        if isinstance(module, Fp8Linear):
            hub_sd[f"{name}.weight"] = module.dequantized(torch.float32)
    for name, param in drafter.named_parameters():
        hub_sd[name] = param.detach()
    for (stage, expert), (w1, w2, w3) in dequantized_expert_weights(drafter.experts_fn).items():
        for proj, weight in (("w1", w1), ("w2", w2), ("w3", w3)):
            hub_sd[f"mtp.{stage}.ffn.experts.{expert}.{proj}.weight"] = weight
    dense = DSparkDrafter.from_state_dict(drafter.config, hub_sd, drafter.embed, drafter.head, FP32)
    assert not any(isinstance(m, Fp8Linear) for m in dense.modules())
    features, positions = _context(drafter.config, 20, seed=4)
    base_q, hidden_q = drafter.propose(features, positions, seed_token_id=5, seed_position=20)
    base_d, hidden_d = dense.propose(features, positions, seed_token_id=5, seed_position=20)
    torch.testing.assert_close(hidden_q, hidden_d, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(base_q, base_d, atol=1e-5, rtol=1e-5)


def test_same_seed_same_drafter_other_seed_other(tiny_dir, tiny_drafter, tmp_path):
    features, positions = _context(tiny_drafter.config, 12, seed=1)
    base, _ = tiny_drafter.propose(features, positions, seed_token_id=3, seed_position=12)
    again = load_drafter(str(tiny_dir), "cpu", FP32)
    assert torch.equal(again.propose(features, positions, seed_token_id=3, seed_position=12)[0], base)
    other = load_drafter(str(_model_dir(tmp_path, seed=6)), "cpu", FP32)
    assert not torch.allclose(other.propose(features, positions, seed_token_id=3, seed_position=12)[0], base)


def test_embed_and_head_are_the_attention_sides(tiny_dir, tiny_drafter, tmp_path):
    from services.attention.random_weights import random_attention_side_for

    _config, side = random_attention_side_for(str(tiny_dir), torch.float32, torch.device("cpu"))
    assert torch.equal(tiny_drafter.embed.weight, side.embed.weight)
    assert torch.equal(tiny_drafter.head.weight, side.head.weight)
    other_embed, _ = target_embed_head(_model_dir(tmp_path, seed=9), torch.float32, "cpu")
    assert not torch.equal(other_embed.weight, side.embed.weight)


def test_stage_gates_follow_the_routing_skew(tiny_dir):
    from services.expert.random_weights import skew_ranks

    config = ModelConfig.load(str(tiny_dir))
    embed, head = target_embed_head(tiny_dir, torch.float32, "cpu")
    drafter = build_random_drafter(config, FP32, "cpu", embed, head, seed=5, routing_skew=2.0)
    for stage, block in enumerate(drafter.mtp):
        ranks = torch.tensor(skew_ranks(config.n_routed_experts, config.num_hidden_layers + stage, 5),
                             dtype=torch.float32)
        torch.testing.assert_close(block.ffn.gate.bias, -2.0 * torch.log1p(ranks))


def test_draft_worker_loads_a_random_dir_and_proposes(tiny_dir):
    worker = DraftWorker(DraftWorkerConfig(checkpoint_path=str(tiny_dir), device="cpu"))
    asyncio.run(worker.load())
    config = worker.drafter.config
    features, _ = _context(config, 20, seed=2)
    segment = m.FeatureSegment("r1", 0, 20, 0, tuple(range(20)))
    assert asyncio.run(worker.handle(m.TargetFeatures(step_id=0, segments=(segment,), features=features))) == m.Ack()
    request = m.DraftRequest(step_id=1, slots=(
        m.DraftSlot("r1", num_draft_tokens=5, last_token_ids=(9,), start_position=20),
        m.DraftSlot("r2", num_draft_tokens=5, last_token_ids=(4,), start_position=0, temperature=1.0, seed=1,
                    first_output_position=0)))
    reply = asyncio.run(worker.handle(request))
    assert isinstance(reply, m.DraftTokens)
    greedy, sampled = reply.proposals
    assert 1 <= len(greedy.token_ids) <= 5 and all(0 <= t < config.vocab_size for t in greedy.token_ids)
    assert all(0 < p <= 1 for p in greedy.draft_probs)
    assert len(sampled.support_token_ids) == len(sampled.token_ids) >= 1
    for token, ids, probs in zip(sampled.token_ids, sampled.support_token_ids, sampled.support_probs):
        assert token in ids and abs(sum(probs) - 1.0) < 1e-5


def test_draft_service_process_serves_a_random_dir(tiny_dir, tmp_path):
    """`services.draft.main.run` (what `moemesh draft --config` calls) on a random directory: Ready,
    features in, drafts out, over real sockets."""
    from draft_support import running_draft_worker, write_draft_deployment

    config_path = write_draft_deployment(tmp_path, tiny_dir)
    hidden = ModelConfig.load(str(tiny_dir)).hidden_size
    features = torch.randn(10, 3 * hidden, generator=torch.Generator().manual_seed(0))

    async def scenario():
        async with running_draft_worker(config_path) as (_, _, client, ready, child):
            assert ready["draft"].role is m.ServiceRole.DRAFT
            segment = m.FeatureSegment("r1", 0, 10, 0, tuple(range(10)))
            assert await client.request(m.TargetFeatures(step_id=0, segments=(segment,), features=features)) == m.Ack()
            reply = await client.request(m.DraftRequest(step_id=2, slots=(
                m.DraftSlot("r1", num_draft_tokens=5, last_token_ids=(7,), start_position=10),)))
            assert isinstance(reply, m.DraftTokens) and 1 <= len(reply.proposals[0].token_ids) <= 5
            child.send_signal(signal.SIGTERM)
            exit_code = await asyncio.to_thread(child.wait, 20)
            assert exit_code == 0, child.stderr.read().decode(errors="replace")[-2000:]

    asyncio.run(scenario())
    log_text = "".join(p.read_text() for p in (tmp_path / "logs").glob("*"))
    assert "draft.random_weights" in log_text


def test_fullsize_draft_bench_runs_tiny_on_cpu(tmp_path):
    """bench.fullsize_draft end to end on the tiny model: figures and floors land in its JSON."""
    import json

    from bench.fullsize_draft import main

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add contention on a shared 2-core box
    try:
        assert main(["--device", "cpu", "--tiny", "--batches", "2", "--temperatures", "0,1", "--repeats", "1",
                     "--warmup", "0", "--out-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(num_threads)
    (path,) = tmp_path.glob("fullsize-draft-*.json")
    record = json.loads(path.read_text())
    (row,) = record["raw"]["batches"]
    assert row["num_requests"] == 2 and set(row["propose"]) == {"temperature_0", "temperature_1"}
    assert all(1 <= n <= 16 for n in row["distinct_experts_per_stage"]) and len(row["distinct_experts_per_stage"]) == 3
    assert row["propose_floor_bytes"] > record["raw"]["weight_groups"]["head_bytes"] > 0
    for figures in row["propose"].values():
        assert figures["num_drafts_min"] == figures["num_drafts_max"] == 5 and figures["ratio_to_floor"] > 0
    assert set(row["add_features"]) == {"rows_1", "rows_5"}
    assert record["ratios"]["propose_A2_temperature_0_vs_floor"] == row["propose"]["temperature_0"]["ratio_to_floor"]


# ------------------------------------------------------------------------------------ CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_random_drafter_is_quantized_and_valid(tmp_path):
    """bf16 on CUDA: FP8/FP4 bytes stay quantized on the device (no dense copies), proposals valid
    and repeatable, embed/head equal to the attention worker's on the same device."""
    from services.attention.random_weights import random_attention_side_for

    model_dir = _model_dir(tmp_path, seed=4, kernel_friendly=True)
    bf16 = NumericsConfig(dtype="bfloat16")
    drafter = load_drafter(str(model_dir), "cuda", bf16)
    config = drafter.config
    wq_b = drafter.mtp[0].attn.wq_b
    assert isinstance(wq_b, Fp8Linear) and wq_b.weight.dtype == torch.float8_e4m3fn and wq_b.weight.is_cuda
    held = drafter.experts_fn._layers[0]
    assert held.w1.dtype == torch.uint8 and held.w1.shape[-1] == config.hidden_size // 2  # FP4 packed
    sizes = drafter_weight_bytes(drafter)
    assert sizes.routed_expert_bytes == 3 * config.n_routed_experts * 3 * (
        config.moe_intermediate_size * config.hidden_size // 2 + config.moe_intermediate_size * config.hidden_size // 32)

    _config, side = random_attention_side_for(str(model_dir), torch.bfloat16, torch.device("cuda"))
    assert torch.equal(drafter.embed.weight, side.embed.weight) and torch.equal(drafter.head.weight, side.head.weight)

    features, positions = _context(config, 32)
    base, hidden = drafter.propose(features.cuda(), positions.cuda(), seed_token_id=5, seed_position=32)
    assert base.dtype == torch.bfloat16 and torch.isfinite(base.float()).all() and base.float().std() > 0.1
    chain = drafter.greedy_chain(base, hidden, seed_token_id=5)
    torch.testing.assert_close(chain.probs.sum(dim=-1), torch.ones(5, device="cuda"), atol=1e-4, rtol=0)
    again = drafter.propose(features.cuda(), positions.cuda(), seed_token_id=5, seed_position=32)[0]
    assert torch.equal(again, base)


@cuda
def test_cuda_quantized_drafter_matches_its_torch_path(tmp_path):
    """The Triton kernels (AUTO on CUDA bf16) against the dequantise + torch path of the same weights:
    the quantized modules compute what their dequantised values imply."""
    from common.model.quantized import KernelBackend

    model_dir = _model_dir(tmp_path, seed=8, kernel_friendly=True)
    config = ModelConfig.load(str(model_dir))
    bf16 = NumericsConfig(dtype="bfloat16")
    embed, head = target_embed_head(model_dir, torch.bfloat16, "cuda")
    kernels = build_random_drafter(config, bf16, "cuda", embed, head, seed=8)
    reference = build_random_drafter(config, bf16, "cuda", embed, head, seed=8, backend=KernelBackend.TORCH)
    features, positions = _context(config, 24, seed=3)
    base_k, _ = kernels.propose(features.cuda(), positions.cuda(), seed_token_id=2, seed_position=24)
    base_t, _ = reference.propose(features.cuda(), positions.cuda(), seed_token_id=2, seed_position=24)
    assert torch.isfinite(base_k.float()).all() and base_t.float().std() > 0.1
    relative = (base_k.float() - base_t.float()).norm() / base_t.float().norm()
    assert relative < 0.05, f"kernel path differs from the torch path by {relative:.3f} (relative L2)"
