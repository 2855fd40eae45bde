"""FP8 rows (main rows and CSA indexer rows) in the attention worker's KV pool, on the CPU: paged rows, the CPU tier,
boundary snapshots (prefix-cache restores and swap-ins), rollbacks of drafts across a block end, a snapshot that could
not be captured, and the bytes a block takes.

Snapshots and swaps copy the stored bytes, so a sequence restored at a block end where a chunk ended continues bit
for bit as one prefilled from scratch with the same chunks (both store FP8 rows). Legend: V vocab.
"""

from __future__ import annotations

import pytest
import torch

from moemesh.bench.checks.tiny_model import tiny_config
from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.config import NumericsConfig
from moemesh.common.model.kv_rows import POISON_BYTE, IndexerRowLayout, MainRowLayout, pack_indexer_rows, pack_main_rows
from moemesh.common.model.kv_storage import KVStorage
from moemesh.common.model.random_init import random_model
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.model.state import SequenceState
from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.boundary import Recorder, recording_state, restore_state
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.services.attention.kv_pool import BlockTable, KVPool, KVPoolError
from moemesh.services.attention.slots import SlotTable

BLOCK = 32
SAMPLING = SamplingParams(temperature=0.0).to_wire()
CHUNKS = ((0, 50), (50, 64), (64, 80))  # block end 32 crossed inside a chunk, 64 at a chunk's end
NUM_DECODE = 3


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    side, experts = random_model(tiny_config(), "cpu", numerics=NumericsConfig(), seed=3)
    return ReferenceModel(side, experts)


@pytest.fixture(scope="module")
def token_ids(model) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (CHUNKS[-1][1],), generator=torch.Generator().manual_seed(5))


def _pool(config, num_primary_blocks: int = 8, num_cpu_blocks: int = 4) -> KVPool:
    return KVPool(config, KVPoolConfig(BLOCK, num_primary_blocks, num_cpu_blocks, kv_storage=KVStorage.FP8,
                                       num_primary_snapshots=6, num_cpu_snapshots=2), torch.float32, "cpu")


def _run(model, state, token_ids, chunks) -> list[torch.Tensor]:
    """Each (start, end) chunk, then NUM_DECODE greedy steps -> logits [V] of every step's last token."""
    out = []
    for start, end in chunks:
        out.append(model.forward(token_ids[start:end], [SequenceChunk(state, end - start)])[-1])
    for _ in range(NUM_DECODE):
        out.append(model.forward(out[-1].argmax().view(1), [SequenceChunk(state, 1)])[-1])
    return out


def _source(model, token_ids, pool):
    """Slot 0 prefilled with CHUNKS[:2] (up to 64) in blocks 0, 1, 2 of an FP8 pool, its snapshots at 32 and 64 in
    snapshots 0 and 1."""
    slots = SlotTable(model.config, pool, torch.float32, torch.device("cpu"))
    for start, end in CHUNKS[:2]:
        slot = slots.prepare(0, "source", start, (0, 1, 2), SAMPLING if start == 0 else None, ((0, 0), (1, 1)))
        model.forward(token_ids[start:end], [SequenceChunk(slot.state, end - start)])
    return slots


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_fp8_rows_round_trip_through_the_cpu_tier_byte_for_byte():
    config = tiny_config()
    pool = _pool(config, num_primary_blocks=4, num_cpu_blocks=4)
    layout = MainRowLayout.of(config)
    table = BlockTable(torch.device("cpu"))
    table.update((3, 1))
    generator = torch.Generator().manual_seed(1)
    store = pool.row_store_factory(table)(1, "compressor", config.head_dim)  # CSA, ratio 4: 8 rows per block
    rows = pack_main_rows(torch.randn(16, config.head_dim, generator=generator), layout)
    index_store = pool.row_store_factory(table)(1, "indexer", config.index_head_dim)
    index_rows = pack_indexer_rows(torch.randn(16, config.index_head_dim, generator=generator),
                                   IndexerRowLayout(config.index_head_dim))  # [16, d + 4] uint8
    for target, packed in ((store, rows), (index_store, index_rows)):
        target.write(0, packed[:5])
        target.write(5, packed[5:])
    pool.move(swap_out=[(3, 0), (1, 2)], swap_in=[])
    for tensor in pool.primary.values():
        tensor.fill_(POISON_BYTE if tensor.dtype == torch.uint8 else float("nan"))
    pool.move(swap_out=[], swap_in=[(0, 2), (2, 0)])
    table.update((2, 0))
    assert torch.equal(store.read(16), rows)
    assert index_store.read(16).dtype == torch.uint8 and torch.equal(index_store.read(16), index_rows)


def test_restore_at_a_chunk_end_continues_bit_for_bit(model, token_ids):
    pool = _pool(model.config)
    slots = _source(model, token_ids, pool)
    reference = SequenceState(model.config, kv_storage=KVStorage.FP8)
    expected = _run(model, reference, token_ids, CHUNKS)
    sealed = {key: tensor[:2].clone() for key, tensor in pool.primary.items()}
    slots.restore(1, "second", (0, 1), 64, 1)
    slot = slots.prepare(1, "second", 64, (0, 1, 3), SAMPLING)
    assert slot.state.kv_storage is KVStorage.FP8
    for got, want in zip(_run(model, slot.state, token_ids, CHUNKS[2:]), expected[2:]):
        assert torch.equal(got, want)
    _assert_same(slot.state.live_tensors(), reference.live_tensors())
    for layer_state, reference_layer in zip(slot.state.layers, reference.layers):  # the ring's very bytes
        assert torch.equal(layer_state.window.ring, reference_layer.window.ring)
    for key, tensor in pool.primary.items():  # shared, full blocks are never written again
        assert torch.equal(tensor[:2], sealed[key]), key


def test_swap_in_after_the_blocks_were_reused(model, token_ids):
    pool = _pool(model.config)
    slots = _source(model, token_ids, pool)
    reference = SequenceState(model.config, kv_storage=KVStorage.FP8)
    expected = _run(model, reference, token_ids, CHUNKS)
    pool.move(swap_out=[(0, 2), (1, 0)], swap_in=[], snapshot_swap_out=[(1, 0)])
    slots.free([0])
    for tensor in (*pool.primary.values(), *pool.snapshot_primary.values()):  # others wrote them meanwhile
        tensor.fill_(POISON_BYTE if tensor.dtype == torch.uint8 else float("nan"))
    pool.move(swap_out=[], swap_in=[(2, 6), (0, 3)], snapshot_swap_in=[(0, 4)])
    slots.restore(0, "source", (6, 3), 64, 4)
    slot = slots.prepare(0, "source", 64, (6, 3, 7), SAMPLING)
    for got, want in zip(_run(model, slot.state, token_ids, CHUNKS[2:]), expected[2:]):
        assert torch.equal(got, want)
    _assert_same(slot.state.live_tensors(), reference.live_tensors())


def test_drafts_rolled_back_across_a_block_end_leave_the_confirmed_snapshot(model, token_ids):
    pool = _pool(model.config, num_primary_blocks=4)
    slots = SlotTable(model.config, pool, torch.float32, torch.device("cpu"))
    slot = slots.prepare(0, "a", 0, (0, 1), SAMPLING, ((0, 3),))
    model.forward(token_ids[:30], [SequenceChunk(slot.state, 30)])
    wrong = torch.full((4,), 7 if token_ids[30] != 7 else 8)
    model.forward(wrong, [SequenceChunk(slot.state, 4)])  # "drafts" 30..33 cross 32
    slot = slots.prepare(0, "a", 30, (0, 1), None, ((0, 3),))  # rolled back to 30
    model.forward(token_ids[30:50], [SequenceChunk(slot.state, 20)])
    restored = slots.restore(1, "b", (0,), 32, 3)
    other = SequenceState(model.config, kv_storage=KVStorage.FP8)  # the same prefix, stopped exactly at 32
    model.forward(token_ids[:30], [SequenceChunk(other, 30)])
    model.forward(token_ids[30:32], [SequenceChunk(other, 2)])
    for layer_state, other_layer in zip(restored.state.layers, other.layers):
        assert torch.equal(layer_state.window.read(24), other_layer.window.read(24))


def test_a_snapshot_that_was_not_captured_is_refused(model, token_ids):
    pool = _pool(model.config, num_primary_blocks=4)
    table = BlockTable(torch.device("cpu"))
    table.update((0, 1))
    recorder = Recorder(pool, table)
    recorder.set_targets(((0, 2),))
    state = recording_state(model.config, pool, table, recorder, torch.float32, torch.device("cpu"))
    model.forward(token_ids[:40], [SequenceChunk(state, 40)])

    def restore_at_32() -> None:
        restored_table = BlockTable(torch.device("cpu"))
        restored_table.update((0,))
        fresh = Recorder(pool, restored_table)
        restore_state(recording_state(model.config, pool, restored_table, fresh, torch.float32, torch.device("cpu")),
                      fresh, 32, 2)

    restore_at_32()  # captured: restores
    recorder.poison((2, "window_snapshot"), 32)
    assert bool((pool.snapshot_primary[(2, "window_snapshot")][2] == POISON_BYTE).all())
    with pytest.raises(KVPoolError, match="holds no"):
        restore_at_32()


def test_a_block_holds_fp8_rows_and_a_snapshot_fp8_window_rows():
    """Per 32-token block of the tiny model (head_dim 32 = 24 + 8: 48-byte FP8 rows instead of 128 fp32 bytes;
    index_head_dim 16: 20-byte FP8 indexer rows instead of 64 fp32 bytes); a resume snapshot's window rows too."""
    config = tiny_config()
    fp8 = _pool(config, num_primary_blocks=1, num_cpu_blocks=0)
    fp32 = KVPool(config, KVPoolConfig(BLOCK, 1, 0), torch.float32, "cpu")
    csa_layers, hca_layers = 2, 1
    rows = csa_layers * (BLOCK // 4) + hca_layers * (BLOCK // 8)  # compressed rows per block
    indexer_rows = csa_layers * (BLOCK // 4)
    assert fp8.num_bytes_per_block() == rows * 48 + indexer_rows * 20
    assert fp32.num_bytes_per_block() == rows * config.head_dim * 4 + indexer_rows * config.index_head_dim * 4
    snapshot_saving = config.num_hidden_layers * config.sliding_window * (config.head_dim * 4 - 48)
    assert fp32.num_bytes_per_snapshot() - fp8.num_bytes_per_snapshot() == snapshot_saving
