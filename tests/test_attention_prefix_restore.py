"""Restoring a sequence at a KV block boundary (prefix-cache hits and swap-ins), without processes.

A source sequence is prefilled through the attention worker's slot table (paged rows plus the resume
snapshots its plans name); a second slot is rebuilt from its blocks and a snapshot and decoded; a plain SequenceState prefilled
from scratch with the same chunk shapes is the reference. Equal chunk shapes give bit-identical
results (different chunkings differ by fp32 rounding, ~3e-7), so a restore at a boundary that
a chunk ended on is checked with torch.equal, and one captured inside a chunk with a tolerance
far below what a wrong position or a missing row would cost.
"""

from __future__ import annotations

import pytest
import torch

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.bench.checks.tiny_model import random_hub_state_dict, split_hub_state_dict, tiny_config
from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.services.attention.kv_pool import KVPool, KVPoolError
from moemesh.services.attention.slots import SlotError, SlotTable

BLOCK = 128
SAMPLING = SamplingParams(temperature=0.0).to_wire()
NUM_PROMPT = 300  # crosses blocks at 128 and 256, CSA (4) and HCA (8) windows
CHUNKS = ((0, 200), (200, 256), (256, 300))  # 128 is crossed inside a chunk, 256 at a chunk's end
NUM_DECODE = 5


def _model(sliding_window: int):
    config = tiny_config(sliding_window=sliding_window)
    hub_sd, _ = random_hub_state_dict(config, seed=21)
    attention_sd, experts = split_hub_state_dict(hub_sd, config)
    return config, ReferenceModel(AttentionSide.from_state_dict(config, attention_sd),
                                  RoutedExperts.from_config(experts, config))


def _run(model, state, token_ids: torch.Tensor, chunks) -> list[torch.Tensor]:
    """Forward each (start, end) chunk, then NUM_DECODE greedy decode steps; logits of every step's last token."""
    out = []
    for start, end in chunks:
        logits = model.forward(token_ids[start:end], [SequenceChunk(state, end - start)])
        out.append(logits[-1])
    for _ in range(NUM_DECODE):
        next_id = out[-1].argmax().view(1)
        out.append(model.forward(next_id, [SequenceChunk(state, 1)])[-1])
    return out


def _assert_same_state(got: dict, expected: dict, exact: bool) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        if exact:
            assert torch.equal(got[name], expected[name]), name
        else:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.fixture(scope="module", params=[8, 128], ids=["window8", "window128"])
def setup(request):
    config, model = _model(request.param)
    token_ids = torch.randint(0, config.vocab_size, (NUM_PROMPT,), generator=torch.Generator().manual_seed(3))
    return config, model, token_ids


def _source(config, model, token_ids, pool_config=None):
    """Slot 0 prefilled with CHUNKS[:2] (up to 256) in blocks 0, 1, 2, its snapshots at 128 and 256 in
    snapshots 0 and 1."""
    pool = KVPool(config, pool_config or KVPoolConfig(BLOCK, num_primary_blocks=8, num_cpu_blocks=4,
                                                      num_primary_snapshots=6, num_cpu_snapshots=2),
                  torch.float32, "cpu")
    slots = SlotTable(config, pool, torch.float32, torch.device("cpu"))
    for start, end in CHUNKS[:2]:
        slot = slots.prepare(0, "source", start, (0, 1, 2), SAMPLING if start == 0 else None, ((0, 0), (1, 1)))
        model.forward(token_ids[start:end], [SequenceChunk(slot.state, end - start)])
    return pool, slots


def test_restore_at_a_chunk_end_is_bit_identical_to_prefill_from_scratch(setup):
    config, model, token_ids = setup
    pool, slots = _source(config, model, token_ids)
    reference = model.new_sequence()
    expected = _run(model, reference, token_ids, CHUNKS)
    sealed = {key: tensor[:2].clone() for key, tensor in pool.primary.items()}
    sealed_snapshots = {key: tensor[1].clone() for key, tensor in pool.snapshot_primary.items()}

    restored = slots.restore(1, "second", (0, 1), 256, 1)
    assert restored.state.num_tokens == 256
    slot = slots.prepare(1, "second", 256, (0, 1, 3), SAMPLING)
    assert slot is restored and slot.params.is_greedy
    got = _run(model, slot.state, token_ids, CHUNKS[2:])
    for got_logits, expected_logits in zip(got, expected[2:]):
        assert torch.equal(got_logits, expected_logits)
    _assert_same_state(slot.state.live_tensors(), reference.live_tensors(), exact=True)
    for key, tensor in pool.primary.items():  # shared, full blocks are never written again
        assert torch.equal(tensor[:2], sealed[key]), key
    for key, tensor in pool.snapshot_primary.items():  # nor the snapshot restored from
        assert torch.equal(tensor[1], sealed_snapshots[key]), key


def test_restore_captured_inside_a_chunk_matches_prefill_from_scratch(setup):
    config, model, token_ids = setup
    pool, slots = _source(config, model, token_ids)
    reference = model.new_sequence()
    chunks = ((0, 128), (128, 256), (256, 300))
    expected = _run(model, reference, token_ids, chunks)
    slots.restore(1, "second", (0,), 128, 0)
    slot = slots.prepare(1, "second", 128, (0, 4, 5), SAMPLING, ((1, 4),))
    got = _run(model, slot.state, token_ids, chunks[1:])
    for got_logits, expected_logits in zip(got, expected[1:]):
        torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    _assert_same_state(slot.state.live_tensors(), reference.live_tensors(), exact=False)
    # the restored slot wrote the snapshot its plan named (4, boundary 256)
    assert pool.snapshot_primary[(0, "window_snapshot")][4].abs().sum() > 0


def test_swap_in_restores_from_blocks_back_from_the_cpu_tier(setup):
    config, model, token_ids = setup
    pool, slots = _source(config, model, token_ids)
    reference = model.new_sequence()
    expected = _run(model, reference, token_ids, CHUNKS)
    pool.move(swap_out=[(0, 2), (1, 0)], swap_in=[], snapshot_swap_out=[(1, 1)])
    slots.free([0])
    for tensor in (*pool.primary.values(), *pool.snapshot_primary.values()):
        tensor.fill_(float("nan"))  # blocks and snapshots reused by others meanwhile: nothing may survive in place
    pool.move(swap_out=[], swap_in=[(2, 6), (0, 3)], snapshot_swap_in=[(1, 5)])
    slots.restore(0, "source", (6, 3), 256, 5)
    slot = slots.prepare(0, "source", 256, (6, 3, 7), SAMPLING)
    got = _run(model, slot.state, token_ids, CHUNKS[2:])
    for got_logits, expected_logits in zip(got, expected[2:]):
        assert torch.equal(got_logits, expected_logits)
    _assert_same_state(slot.state.live_tensors(), reference.live_tensors(), exact=True)


def test_drafts_rolled_back_across_a_boundary_rewrite_its_snapshot(setup):
    """Tokens computed past a block end and rolled back (rejected drafts) leave a snapshot that the
    confirmed tokens overwrite when they cross the boundary again."""
    config, model, token_ids = setup
    pool = KVPool(config, KVPoolConfig(BLOCK, num_primary_blocks=4), torch.float32, "cpu")
    slots = SlotTable(config, pool, torch.float32, torch.device("cpu"))
    slot = slots.prepare(0, "a", 0, (0, 1), SAMPLING, ((0, 0),))
    model.forward(token_ids[:126], [SequenceChunk(slot.state, 126)])
    wrong = torch.tensor([7, 7, 7, 7]) if token_ids[126] != 7 else torch.tensor([8, 8, 8, 8])
    model.forward(wrong, [SequenceChunk(slot.state, 4)])  # "drafts" 126..129 cross 128
    slot = slots.prepare(0, "a", 126, (0, 1), None, ((0, 0),))  # rolled back to 126
    model.forward(token_ids[126:200], [SequenceChunk(slot.state, 74)])
    reference = model.new_sequence()
    model.forward(token_ids[:126], [SequenceChunk(reference, 126)])
    model.forward(token_ids[126:200], [SequenceChunk(reference, 74)])
    restored = slots.restore(1, "b", (0,), 128, 0)
    other = model.new_sequence()  # the same prefix, stopped exactly at 128
    model.forward(token_ids[:126], [SequenceChunk(other, 126)])
    model.forward(token_ids[126:128], [SequenceChunk(other, 2)])
    _assert_same_state(restored.state.live_tensors(), other.live_tensors(), exact=False)


def test_bad_restores_are_refused():
    config, _ = _model(8)
    pool = KVPool(config, KVPoolConfig(BLOCK, num_primary_blocks=4, num_primary_snapshots=4), torch.float32, "cpu")
    slots = SlotTable(config, pool, torch.float32, torch.device("cpu"))
    with pytest.raises(SlotError):
        slots.restore(0, "x", (0,), 100, 0)  # not a block boundary
    with pytest.raises(SlotError):
        slots.restore(0, "x", (0, 1), 128, 0)  # blocks do not match the token count
    with pytest.raises(KVPoolError):
        slots.restore(0, "x", (9,), 128, 0)  # outside the tier
    with pytest.raises(KVPoolError, match="snapshot 4"):
        slots.restore(0, "x", (0,), 128, 4)  # a snapshot outside the tier
    with pytest.raises(KVPoolError, match="outside the primary tier"):
        slots.prepare(0, "x", 0, (0,), SAMPLING, ((0, -1),))  # a target outside the tier
    slots.free([0])
    assert 0 not in slots.slots
    restored = slots.restore(0, "x", (0,), 128, 0)
    with pytest.raises(SlotError):
        slots.prepare(0, "x", 128, (0, 1), None)  # a restored slot still needs its sampling params
    restored.params = None
    slots.prepare(0, "x", 128, (0, 1), SAMPLING)
    with pytest.raises(SlotError):
        slots.prepare(0, "x", 120, (0, 1), None)  # below the restore point (shared blocks)


def test_only_the_block_ends_a_plan_names_get_a_snapshot(setup):
    """A step records the resume snapshots of the block ends its plan names, and no other: the snapshot tier
    holds what resumes need, not one snapshot per block."""
    config, model, token_ids = setup
    pool = KVPool(config, KVPoolConfig(BLOCK, num_primary_blocks=4, num_primary_snapshots=3), torch.float32, "cpu")
    slots = SlotTable(config, pool, torch.float32, torch.device("cpu"))
    slot = slots.prepare(0, "a", 0, (0, 1, 2), SAMPLING, ((1, 2),))  # 128 crossed without a target, 256 with one
    model.forward(token_ids[:NUM_PROMPT], [SequenceChunk(slot.state, NUM_PROMPT)])
    for key, tensor in pool.snapshot_primary.items():
        assert not tensor[:2].any(), key  # snapshots 0 and 1 untouched
    assert pool.snapshot_primary[(0, "window_snapshot")][2].any()
    restored = slots.restore(1, "b", (0, 1), 256, 2)
    reference = model.new_sequence()
    model.forward(token_ids[:256], [SequenceChunk(reference, 256)])
    _assert_same_state(restored.state.live_tensors(), reference.live_tensors(), exact=False)
