"""Batched Markov chains (common/drafting/chains.py `batched_chains`) equal the per-request chains.

The draft worker runs every drafted request's chain together, slot by slot; each row must give
exactly what `DSparkDrafter.greedy_chain` (greedy rows) or `sparse_sampled_chain` (sampled rows,
truncated or full support) gives for that request alone: the same tokens, the same q and
confidences, the same supports, whatever the other rows are.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from moemesh.common.drafting.chains import batched_chains, sparse_sampled_chain
from moemesh.common.drafting.proposer import DrafterConfig
from moemesh.services.draft.worker import DraftWorker

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="default model not present")


@pytest.fixture(scope="module")
def drafter():
    worker = DraftWorker(DrafterConfig(checkpoint_path=str(MODEL)))
    asyncio.run(worker.load())
    return worker.drafter


def _block(drafter, num_rows: int, seed: int):
    """base logits [A, G, V] and hidden [A, G, D] of random contexts."""
    generator = torch.Generator().manual_seed(seed)
    config = drafter.config
    width = len(drafter.dspark.target_layer_ids) * config.hidden_size
    main_x = drafter.fuse_features(torch.randn(num_rows * 20, width, generator=generator)).view(num_rows, 20, -1)
    positions = torch.arange(20).expand(num_rows, -1)
    valid = torch.ones(num_rows, 20, dtype=torch.bool)
    seeds = torch.randint(20, 2000, (num_rows,), generator=generator)
    block_positions = 20 + torch.arange(drafter.dspark.block_size).expand(num_rows, -1)
    with torch.no_grad():
        hidden = drafter.block_hidden(main_x, positions, valid, drafter.block_inputs(seeds), block_positions)
        return drafter.base_logits(hidden), hidden, seeds.tolist()


@pytest.mark.parametrize("max_support", [64, None])
def test_each_row_of_the_batch_is_the_requests_own_chain(drafter, max_support):
    base, hidden, seed_tokens = _block(drafter, 5, seed=3)
    temperatures = [0.0, 1.0, 0.7, 0.0, 1.3]
    seeds = [None, 11, 12, None, 13]
    positions = [None, 0, 9, None, 4]
    chains = batched_chains(drafter, base, hidden, seed_tokens, temperatures, seeds, positions, max_support)
    for a in range(5):
        if temperatures[a] == 0:
            alone = drafter.greedy_chain(base[a], hidden[a], seed_tokens[a])
            assert chains.token_ids[a] == alone.token_ids.tolist()
            expected = alone.probs.gather(1, alone.token_ids[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(chains.chosen_probs[a]), expected, rtol=1e-5, atol=1e-7)
            assert all(ids == () for ids in chains.support_ids[a])
        else:
            alone = sparse_sampled_chain(drafter, base[a], hidden[a], seed_tokens[a], temperature=temperatures[a],
                                         seed=seeds[a], output_positions=range(positions[a], positions[a] + 5),
                                         max_support=max_support)
            assert chains.token_ids[a] == alone.token_ids.tolist()
            torch.testing.assert_close(torch.tensor(chains.chosen_probs[a]), alone.probs, rtol=1e-5, atol=1e-7)
            for k in range(5):
                assert chains.support_ids[a][k] == tuple(alone.support_ids[k].tolist())
                torch.testing.assert_close(torch.tensor(chains.support_probs[a][k]), alone.support_probs[k],
                                           rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(torch.tensor(chains.confidences[a]), alone.confidences, rtol=1e-5, atol=1e-7)


def test_a_row_does_not_depend_on_the_other_rows(drafter):
    base, hidden, seed_tokens = _block(drafter, 4, seed=8)
    args = dict(temperatures=[1.0] * 4, seeds=[5, 6, 7, 8], first_output_positions=[3, 3, 3, 3], max_support=64)
    together = batched_chains(drafter, base, hidden, seed_tokens, **args)
    for a in range(4):
        alone = batched_chains(drafter, base[a:a + 1], hidden[a:a + 1], seed_tokens[a:a + 1],
                               **{key: value[a:a + 1] if isinstance(value, list) else value
                                  for key, value in args.items()})
        assert alone.token_ids[0] == together.token_ids[a]
        assert alone.support_ids[0] == together.support_ids[a]
