"""The draft worker on a checkpoint written by `moemesh bench make-checkpoint --dspark`: in process and
as a service process over real sockets it loads the DSpark stages and the target's embed and head from
disk and answers feature and draft messages; `bench.fullsize_draft` runs end to end on it; with CUDA the
bf16 drafter's proposals are valid and repeatable (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import torch

from moemesh.bench.random_checkpoint import cached_checkpoint, hub_config
from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.model.config import ModelConfig, NumericsConfig
from moemesh.common.wire import messages as m
from moemesh.common.drafting.proposer import DrafterConfig, load_drafter
from moemesh.services.draft.worker import DraftWorker

# widths the Triton kernels take (multiples of 128 at K), for the CUDA check
KERNEL_FRIENDLY = dict(hidden_size=256, moe_intermediate_size=128, head_dim=128, qk_rope_head_dim=16, q_lora_rank=128,
                       o_lora_rank=128, index_head_dim=32)


def _checkpoint(cache: Path, seed: int = 5, **overrides) -> Path:
    hub = hub_config("tiny", num_layers=4, dspark=True, overrides=overrides)
    return cached_checkpoint(hub, seed=seed, cache_dir=cache, progress=None)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("draft-checkpoint"))


def _context(config: ModelConfig, num_positions: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(num_positions, 3 * config.hidden_size, generator=generator)  # [C, F]
    return features, torch.arange(num_positions)


def test_draft_worker_loads_the_checkpoint_and_proposes(tiny_dir):
    worker = DraftWorker(DrafterConfig(checkpoint_path=str(tiny_dir), device="cpu"))
    asyncio.run(worker.load())
    config = worker.drafter.config
    assert config.dspark.target_layer_ids == (1, 2, 3) and len(worker.drafter.mtp) == 3
    torch.testing.assert_close(worker.drafter.head.weight.float(), CheckpointReader(tiny_dir).load("head.weight").float())
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


def test_same_seed_same_drafter_other_seed_other(tiny_dir, tmp_path):
    fp32 = NumericsConfig(dtype="float32")
    drafter = load_drafter(str(tiny_dir), "cpu", fp32)
    features, positions = _context(drafter.config, 12, seed=1)
    base, _ = drafter.propose(features, positions, seed_token_id=3, seed_position=12)
    again = load_drafter(str(_checkpoint(tmp_path, seed=5)), "cpu", fp32)  # written anew, same arguments
    assert torch.equal(again.propose(features, positions, seed_token_id=3, seed_position=12)[0], base)
    other = load_drafter(str(_checkpoint(tmp_path, seed=6)), "cpu", fp32)
    assert not torch.allclose(other.propose(features, positions, seed_token_id=3, seed_position=12)[0], base)


def test_draft_service_process_serves_the_checkpoint(tiny_dir, tmp_path):
    """`services.draft.main.run` (what `moemesh draft --config` calls): Ready, features in, drafts out."""
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


def test_fullsize_draft_bench_runs_tiny_on_cpu(tmp_path):
    """bench.fullsize_draft end to end on the tiny checkpoint: figures and floors land in its JSON."""
    import json

    from moemesh.bench.fullsize_draft import main

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add contention on a shared 2-core box
    try:
        assert main(["--device", "cpu", "--tiny", "--batches", "2", "--temperatures", "0,1", "--repeats", "1",
                     "--warmup", "0", "--checkpoint-cache", str(tmp_path / "checkpoints"),
                     "--out-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(num_threads)
    (path,) = tmp_path.glob("fullsize-draft-*.json")
    record = json.loads(path.read_text())
    assert record["raw"]["checkpoint"].startswith(str(tmp_path / "checkpoints"))
    (row,) = record["raw"]["batches"]
    assert row["num_requests"] == 2 and set(row["propose"]) == {"temperature_0", "temperature_1"}
    assert all(1 <= n <= 16 for n in row["distinct_experts_per_stage"]) and len(row["distinct_experts_per_stage"]) == 3
    assert row["propose_floor_bytes"] > record["raw"]["weight_groups"]["head_bytes"] > 0
    sizes = record["raw"]["weight_bytes"]
    assert sizes["routed_expert_bytes"] > 0 and sizes["total_bytes"] > sizes["own_bytes"] > 0
    for figures in row["propose"].values():
        assert figures["num_drafts_min"] == figures["num_drafts_max"] == 5 and figures["ratio_to_floor"] > 0
    assert set(row["add_features"]) == {"rows_1", "rows_5"}
    assert record["ratios"]["propose_A2_temperature_0_vs_floor"] == row["propose"]["temperature_0"]["ratio_to_floor"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_drafter_from_the_checkpoint_is_valid(tmp_path):
    """bf16 on CUDA: the drafter loaded from a kernel-sized checkpoint proposes finite, repeatable blocks
    whose greedy chain is a distribution per slot; the embed is the checkpoint's."""
    model_dir = _checkpoint(tmp_path, seed=4, **KERNEL_FRIENDLY)
    drafter = load_drafter(str(model_dir), "cuda", NumericsConfig(dtype="bfloat16"))
    config = drafter.config
    embed = CheckpointReader(model_dir).load("embed.weight", torch.bfloat16)
    assert torch.equal(drafter.embed.weight.cpu(), embed)
    features, positions = _context(config, 32)
    base, hidden = drafter.propose(features.cuda(), positions.cuda(), seed_token_id=5, seed_position=32)
    assert base.dtype == torch.bfloat16 and torch.isfinite(base.float()).all() and base.float().std() > 0.1
    chain = drafter.greedy_chain(base, hidden, seed_token_id=5)
    torch.testing.assert_close(chain.probs.sum(dim=-1), torch.ones(5, device="cuda"), atol=1e-4, rtol=0)
    again = drafter.propose(features.cuda(), positions.cuda(), seed_token_id=5, seed_position=32)[0]
    assert torch.equal(again, base)
