"""KV tiers of the attention worker's pool, without processes."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.model.state import SequenceState
from moemesh.bench.checks.tiny_model import random_hub_state_dict, split_hub_state_dict, tiny_config
from moemesh.common.model.attention_side import AttentionSide
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.services.attention.kv_pool import BlockTable, KVPool, KVPoolError


def test_paged_rows_round_trip_through_the_cpu_tier():
    config = tiny_config()
    pool = KVPool(config, KVPoolConfig(block_size_tokens=8, num_primary_blocks=4, num_cpu_blocks=4),
                  torch.float32, "cpu")
    segment = pool.sizing.row_segments[0]  # fp32 rows: width = row dim
    (layer, which), ratio, row_dim = segment.key, 8 // segment.num_rows, segment.width
    table = BlockTable(torch.device("cpu"))
    table.update((3, 1))
    store = pool.row_store_factory(table)(layer, which, row_dim)
    rows = torch.randn(16 // ratio, row_dim)
    store.write(0, rows[:1])
    store.write(1, rows[1:])
    assert torch.equal(store.read(rows.shape[0]), rows)
    pool.move(swap_out=[(3, 0), (1, 2)], swap_in=[])
    pool.primary[(layer, which)].zero_()
    pool.move(swap_out=[], swap_in=[(0, 2), (2, 0)])  # back into other primary blocks
    table.update((2, 0))
    assert torch.equal(store.read(rows.shape[0]), rows)
    assert pool.num_blocks_swapped_out == 2 and pool.num_blocks_swapped_in == 2
    with pytest.raises(KVPoolError):
        store.read(rows.shape[0] + 16)  # beyond the table
    with pytest.raises(KVPoolError):
        pool.move(swap_out=[(4, 0)], swap_in=[])


def test_sequence_state_with_paged_rows_gives_the_same_logits():
    config = tiny_config()
    hub_sd, _ = random_hub_state_dict(config, seed=11)
    attention_sd, experts = split_hub_state_dict(hub_sd, config)
    model = ReferenceModel(AttentionSide.from_state_dict(config, attention_sd),
                           RoutedExperts.from_config(experts, config))
    pool = KVPool(config, KVPoolConfig(block_size_tokens=16, num_primary_blocks=6), torch.float32, "cpu")
    table = BlockTable(torch.device("cpu"))
    table.update((5, 2, 0))
    paged = SequenceState(config, row_store_factory=pool.row_store_factory(table))
    plain = model.new_sequence()
    token_ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    for start, end in ((0, 13), (13, 14), (14, 37), (37, 40)):
        chunk = token_ids[start:end]
        expected = model.forward(chunk, [SequenceChunk(plain, len(chunk))])
        got = model.forward(chunk, [SequenceChunk(paged, len(chunk))])
        assert torch.equal(got, expected)
