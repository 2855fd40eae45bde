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


def test_truncated_q_is_the_renormalised_top_of_the_full_softmax():
    """top_support takes the S largest logits and a softmax over them / T: the full softmax kept on its S
    largest entries and renormalised, ids ascending (no [V] softmax computed)."""
    from moemesh.common.drafting.chains import top_support, truncated_distribution

    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 500, generator=generator) * 4  # [R, V]
    for temperature in (0.6, 1.0, 1.7):
        ids, probs = top_support(logits, torch.full((3, 1), temperature), 32)  # [R, 32]
        full = torch.softmax(logits / temperature, dim=-1)
        top_probs, top_ids = torch.topk(full, 32, dim=-1)
        assert torch.equal(ids, top_ids.sort(dim=-1).values)
        torch.testing.assert_close(probs, full.gather(1, ids) / top_probs.sum(dim=-1, keepdim=True),
                                   rtol=1e-5, atol=1e-8)
        dense = truncated_distribution(logits[0], temperature, 32)  # [V]
        assert torch.equal(dense[ids[0]], probs[0]) and int((dense > 0).sum()) == 32


def test_the_support_breaks_ties_at_its_last_place_toward_lower_ids():
    """Equal logits at the S-th place (bf16 logits have few values): the lower ids are kept, every larger logit
    is, and negative logits and -0.0 / +0.0 rank by value."""
    from moemesh.common.drafting.chains import support_keys, top_support

    logits = torch.tensor([[0.5, 2.0, 0.5, -1.0, 0.5, 3.0, -0.0, 0.0, -2.5, 0.5]])
    ids, _ = top_support(logits, torch.ones(1, 1), 4)
    assert ids.tolist() == [[0, 1, 2, 5]]
    order = torch.argsort(support_keys(logits)[0], descending=True).tolist()
    assert order == [5, 1, 0, 2, 4, 9, 7, 6, 3, 8]


def test_a_batch_of_sampled_rows_draws_what_those_rows_draw_beside_greedy_ones(drafter):
    """With every row sampled the chains skip the greedy argmax and its softmax; the rows get what they get in a
    batch that also has greedy rows."""
    base, hidden, seed_tokens = _block(drafter, 3, seed=5)
    sampled = batched_chains(drafter, base[1:], hidden[1:], seed_tokens[1:], [1.0, 0.8], [21, 22], [2, 6], 64)
    mixed = batched_chains(drafter, base, hidden, seed_tokens, [0.0, 1.0, 0.8], [None, 21, 22], [None, 2, 6], 64)
    for a in range(2):
        assert sampled.token_ids[a] == mixed.token_ids[a + 1]
        assert sampled.support_ids[a] == mixed.support_ids[a + 1]
        for values, expected in ((sampled.chosen_probs[a], mixed.chosen_probs[a + 1]),
                                 (sampled.support_probs[a], mixed.support_probs[a + 1]),
                                 (sampled.confidences[a], mixed.confidences[a + 1])):  # up to the batch's rounding
            torch.testing.assert_close(torch.tensor(values), torch.tensor(expected), rtol=1e-5, atol=1e-8)
