"""The draft worker loads the DeepSeek-V4-Flash-0731 layout (docs/speculation.md §3.1): the drafter built into a
sharded checkpoint, its heads (`mtp.2.markov_head.*`, `mtp.2.confidence_head.*`) in the last shard,
`compress_ratios` covering the main layers plus the draft blocks (ratio 0). Proposals from that
layout equal those from the same weights in one file, bit for bit."""

from __future__ import annotations

import asyncio
import json

import torch

from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.wire import messages as m
from moemesh.common.speculation_width import SpeculationConfig, SpeculationMode
from moemesh.common.drafting.proposer import DrafterConfig
from moemesh.services.draft.worker import DraftWorker

BLOCK = 5


def _proposals(path) -> m.DraftTokens:
    worker = DraftWorker(DrafterConfig(checkpoint_path=str(path),
                                           speculation=SpeculationConfig(SpeculationMode.FIXED, width=BLOCK)))
    asyncio.run(worker.load())
    width = len(worker.drafter.dspark.target_layer_ids) * worker.drafter.config.hidden_size
    slots = []
    for index, count in enumerate((3, 20, 130)):  # the last one wraps the 128-position ring
        features = torch.randn(count, width, generator=torch.Generator().manual_seed(index))  # [n, F]
        segment = m.FeatureSegment(f"r{index}", 0, count, 0, tuple(range(count)))
        worker.add_features(m.TargetFeatures(step_id=0, segments=(segment,), features=features))
        slots.append(m.DraftSlot(f"r{index}", BLOCK, (7 + index,), count))
    slots.append(m.DraftSlot("sampled", BLOCK, (9,), 20, temperature=1.0, seed=3, first_output_position=0))
    segment = m.FeatureSegment("sampled", 0, 20, 0, tuple(range(20)))
    worker.add_features(m.TargetFeatures(step_id=0, segments=(segment,), features=torch.randn(
        20, width, generator=torch.Generator().manual_seed(9))))
    return worker.propose(m.DraftRequest(step_id=1, slots=tuple(slots)))


def test_the_0731_layout_loads_and_drafts_like_a_single_file(tmp_path):
    config = tiny_config(num_nextn_predict_layers=3, compress_ratios=[0, 4, 128, 4, 0, 0, 0], dspark_block_size=BLOCK,
                         dspark_markov_rank=32, dspark_target_layer_ids=[1, 2, 3], dspark_noise_token_id=255)
    state = random_hub_state_dict(config, seed=4)
    single = write_checkpoint(tmp_path / "single", config, state)
    sharded = write_checkpoint(tmp_path / "sharded", config, state, max_shard_bytes=256 * 1024)
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 3
    heads = [name for name in weight_map if name.startswith(("mtp.2.markov_head.", "mtp.2.confidence_head."))]
    assert heads and {weight_map[name] for name in heads} == {shards[-1]}  # the heads live in the last shard
    assert any(weight_map[name] != shards[-1] for name in weight_map if name.startswith("mtp."))  # mtp spans shards
    hub = json.loads((sharded / "config.json").read_text())
    assert hub["dspark_block_size"] == BLOCK
    assert len(hub["compress_ratios"]) == hub["num_hidden_layers"] + 3  # 43 + 3 = 46 entries on V4-Flash

    one_file, layout_0731 = _proposals(single), _proposals(sharded)
    assert [p.token_ids for p in layout_0731.proposals] == [p.token_ids for p in one_file.proposals]
    assert [p.confidences for p in layout_0731.proposals] == [p.confidences for p in one_file.proposals]
    assert [p.support_probs for p in layout_0731.proposals] == [p.support_probs for p in one_file.proposals]
    assert all(len(p.token_ids) == BLOCK for p in one_file.proposals)
