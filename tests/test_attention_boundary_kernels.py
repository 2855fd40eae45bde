"""Boundary snapshots taken on the Triton kernel path (services/attention/boundary.py `mark_written`).

The kernel path writes the rings in place and only calls `mark_written`, never `append`; the
recording stores must then copy each crossed block end's snapshot from the rings. A source
sequence is prefilled and decoded through the KERNEL path with a recording state, crossing block
ends deep inside a chunk (16), near a chunk's end (32), at a chunk's end (48) and during
single-token decode (64); each is restored into a fresh slot and decoded greedily, against a plain
state run through the kernel path over the same tokens (one chunk up to the boundary: a different
chunking, hence a tolerance far below what a garbage snapshot costs). Block ends inside a chunk are
snapshotted from the new rows before the kernels write the rings (`record_write`), so plain rings
capture every block end too; a block end no hook saw and the ring no longer holds is poisoned and
its restore refused (checked kernel-free below).

CPU: the kernels under TRITON_INTERPRET=1 in a child process (the interpreter is chosen when a
kernel is decorated), which runs this file as a script and prints one JSON line per case.
CUDA: the same cases in-process in fp32 (skipped without CUDA). Also a kernel-free check that a
ring write + `mark_written` / `commit_kernel_writes` records what `append` records.
Legend: B tokens per block, W sliding window, V vocabulary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # when run as a script (the interpreter child)
    sys.path.insert(0, str(REPO_ROOT))

from moemesh.common.model.state import SequenceState  # noqa: E402
from moemesh.bench.checks.tiny_model import tiny_config  # noqa: E402
from moemesh.bench.checks.decode_graphs import tiny_graph_config  # noqa: E402
from moemesh.services.attention.boundary import Recorder, recording_state, restore_state  # noqa: E402
from moemesh.services.attention.kv_config import KVPoolConfig  # noqa: E402
from moemesh.services.attention.kv_pool import BlockTable, KVPool, KVPoolError  # noqa: E402

BLOCK = 16  # a multiple of the tiny model's ratios (4, 8); W = 8, max rollback 8
NUM_BLOCKS = 12
CHUNKS = ((0, 40), (40, 48), (48, 60))  # 16 deep inside, 32 near the end, 48 at the end of a chunk
NUM_SOURCE_DECODE = 6  # 60 .. 65: crosses 64 in single-token decode
BOUNDARIES = (16, 32, 48, 64)
NUM_RESTORED_DECODE = 3
MAX_CHUNK_TOKENS = 40


# ---------------------------------------------------------------------------------- the cases
def _kernel_forward(model, token_ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
    """One sequence's chunk through the Triton attention path -> logits [T, V] (ReferenceModel.forward
    with the backend forced, so that it runs on CPU under the interpreter too)."""
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk

    side = model.side
    with torch.inference_mode():
        batch = ForwardBatch([SequenceChunk(state, token_ids.shape[0])], token_ids.device,
                             attention_backend=AttentionBackend.TRITON)
        assert batch.attention_tables is not None, "the kernel path was not taken"
        h = side.embed_tokens(token_ids)
        for layer in range(model.config.num_hidden_layers):
            h = side.attn_block(layer, h, batch)
            x, post, comb = side.ffn_pre(layer, h)
            ids, weights = side.gate(layer, x, token_ids)
            routed = model.experts_fn(layer, x, ids, weights)
            h = side.ffn_post(layer, routed + side.shared_expert(layer, x), h, post, comb)
        batch.finish()
        return side.logits(h, None)


def _decode(model, state, last_logits: torch.Tensor, num_steps: int) -> tuple[list[int], list[torch.Tensor]]:
    token_ids, logits = [], []
    for _ in range(num_steps):
        next_id = last_logits.argmax().view(1)
        token_ids.append(int(next_id))
        last_logits = _kernel_forward(model, next_id, state)[-1]
        logits.append(last_logits)
    return token_ids, logits


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.float(), expected.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6))


def _state_error(got: SequenceState, expected: SequenceState) -> float:
    got_tensors, expected_tensors = got.live_tensors(), expected.live_tensors()
    assert got_tensors.keys() == expected_tensors.keys()
    errors = [0.0]
    for name, tensor in expected_tensors.items():
        if got_tensors[name].shape != tensor.shape:
            return float("inf")
        if tensor.numel():
            errors.append(_relative_error(got_tensors[name], tensor))
    return max(errors)


def run_cases(device: str) -> list[dict]:
    from moemesh.common.model.config import NumericsConfig
    from moemesh.common.model.random_init import random_model
    from moemesh.common.model.reference import ReferenceModel

    dtype = torch.float32  # fp32 on CUDA too: bf16 numerics make FP8 linears, whose 128 blocks the tiny widths lack
    config = tiny_graph_config()
    side, experts = random_model(config, device, numerics=NumericsConfig(dtype=str(dtype).removeprefix("torch.")),
                                 seed=5)
    model = ReferenceModel(side, experts)
    prompt = torch.randint(0, config.vocab_size, (CHUNKS[-1][1],), generator=torch.Generator().manual_seed(3))
    records = []
    for max_chunk_tokens in (MAX_CHUNK_TOKENS, None):
        pool = KVPool(config, KVPoolConfig(BLOCK, num_primary_blocks=NUM_BLOCKS), dtype, device)
        table = BlockTable(torch.device(device))
        table.update(range(5))  # blocks 0..4: positions 0 .. 79
        source_recorder = Recorder(pool, table)
        source_recorder.set_targets((index, index) for index in range(5))  # every block end: snapshot k for block k
        source = recording_state(config, pool, table, source_recorder, dtype, torch.device(device),
                                 max_chunk_tokens=max_chunk_tokens)
        for start, end in CHUNKS:
            last_logits = _kernel_forward(model, prompt[start:end].to(device), source)[-1]
        decoded, _ = _decode(model, source, last_logits, NUM_SOURCE_DECODE)
        all_ids = torch.cat([prompt, torch.tensor(decoded)]).to(device)  # the source's tokens
        for boundary in BOUNDARIES:
            record = {"max_chunk_tokens": max_chunk_tokens, "boundary": boundary}
            restored_table = BlockTable(torch.device(device))
            num_blocks = boundary // BLOCK
            restored_table.update(list(range(num_blocks)) + [6 + num_blocks])  # a fresh block to decode into
            recorder = Recorder(pool, restored_table)
            restored = recording_state(config, pool, restored_table, recorder, dtype, torch.device(device))
            try:
                restore_state(restored, recorder, boundary, boundary // BLOCK - 1)
            except KVPoolError as error:
                records.append({**record, "refused": str(error)})
                continue
            reference = SequenceState(config, dtype=dtype, device=device)
            _kernel_forward(model, all_ids[:boundary], reference)
            record["state_error_at_boundary"] = _state_error(restored, reference)
            # restored and reference both stand at `boundary`; feed the source's next token, then decode
            next_id = all_ids[boundary:boundary + 1]
            got_last = _kernel_forward(model, next_id, restored)[-1]
            expected_last = _kernel_forward(model, next_id, reference)[-1]
            got_ids, got_logits = _decode(model, restored, got_last, NUM_RESTORED_DECODE)
            expected_ids, expected_logits = _decode(model, reference, expected_last, NUM_RESTORED_DECODE)
            record["logits_error"] = max(_relative_error(g, e) for g, e in
                                         zip([got_last, *got_logits], [expected_last, *expected_logits]))
            record["same_tokens"] = got_ids == expected_ids
            record["state_error_after_decode"] = _state_error(restored, reference)
            records.append(record)
    return records


# ---------------------------------------------------------------------------------- the tests
def _check(records: list[dict], tolerance: float) -> None:
    by_key = {(record["max_chunk_tokens"], record["boundary"]): record for record in records}
    assert len(by_key) == 2 * len(BOUNDARIES), records
    for boundary in BOUNDARIES:
        record = by_key[(MAX_CHUNK_TOKENS, boundary)]  # rings sized for the chunk: every end captured
        assert "refused" not in record, record
        assert record["state_error_at_boundary"] <= tolerance, record
        assert record["logits_error"] <= tolerance, record
        assert record["state_error_after_decode"] <= tolerance, record
        # plain rings: 16 lies 24 tokens before the end of a 40-token chunk, beyond W + 8 rows of ring,
        # so only the record_write hook (rows snapshotted before the kernel writes them) captures it
        plain = by_key[(None, boundary)]
        assert "refused" not in plain, plain
        assert plain["state_error_at_boundary"] <= tolerance, plain
        assert plain["logits_error"] <= tolerance, plain
        assert plain["state_error_after_decode"] <= tolerance, plain


@pytest.mark.timeout(240)
def test_kernel_path_snapshots_restore_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=220)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and records, f"rc {proc.returncode}:\n{proc.stderr[-4000:]}"
    _check(records, tolerance=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_path_snapshots_restore_cuda():
    pytest.importorskip("triton")
    _check(run_cases("cuda"), tolerance=1e-3)


@pytest.mark.parametrize("via_commit", [False, True], ids=["mark_written", "commit_kernel_writes"])
def test_ring_writes_record_what_append_records(via_commit):
    """Rows written straight into the rings (as a kernel does), then `mark_written` (or a graph
    replay's `commit_kernel_writes`), leave the same snapshots as the append path, for writes that
    end on, just past, and up to the ring reach past a block end (decode steps, verifications)."""
    config = tiny_config(sliding_window=8)
    generator = torch.Generator().manual_seed(0)
    steps = (5, 11, 1, 1, 8, 6, 1, 1, 1, 9, 4)  # ends 5, 16, 17, 18, 26, 32, 33, 34, 35, 44, 48

    def build():
        pool = KVPool(config, KVPoolConfig(BLOCK, num_primary_blocks=4), torch.float32, "cpu")
        table = BlockTable(torch.device("cpu"))
        table.update(range(3))
        recorder = Recorder(pool, table)
        recorder.set_targets(((0, 0), (1, 1), (2, 2)))
        return pool, recording_state(config, pool, table, recorder, torch.float32, torch.device("cpu"))

    (pool_a, by_append), (pool_k, by_kernel) = build(), build()
    for num_new in steps:
        start = by_append.num_tokens
        for layer_a, layer_k in zip(by_append.layers, by_kernel.layers):
            rows = torch.randn(num_new, config.head_dim, generator=generator)
            layer_a.window.append(rows)
            slots = torch.arange(start, start + num_new) % layer_k.window.ring_size
            layer_k.window.ring[slots] = rows
            for store_a, store_k in ((layer_a.compressor, layer_k.compressor), (layer_a.indexer, layer_k.indexer)):
                if store_a is None:
                    continue
                kv, score = (torch.randn(num_new, store_a.input_rings[0].shape[1], generator=generator)
                             for _ in range(2))
                store_a.append_inputs(kv, score)
                ring_kv, ring_score = store_k.input_rings
                slots = torch.arange(start, start + num_new) % store_k.ring_size
                ring_kv[slots], ring_score[slots] = kv, score
            if not via_commit:
                for store in layer_k.stores():
                    store.mark_written(num_new)
        by_append.advance(num_new)
        if via_commit:
            by_kernel.commit_kernel_writes(num_new)
        else:
            by_kernel.advance(num_new)
    snapshot_keys = list(pool_a.snapshot_primary)
    assert snapshot_keys
    for key in snapshot_keys:
        assert pool_a.snapshot_primary[key][:3].abs().sum() > 0, key
        assert torch.equal(pool_k.snapshot_primary[key][:3], pool_a.snapshot_primary[key][:3]), key


def test_a_write_past_the_ring_reach_without_record_write_is_poisoned_and_refused():
    """A kernel write that no record_write saw (e.g. a caller that bypasses the hook) and that ran
    past the ring's reach cannot be snapshotted: the block end is poisoned and its restore refused,
    never rebuilt from overwritten rows."""
    config = tiny_config(sliding_window=8)
    pool = KVPool(config, KVPoolConfig(BLOCK, num_primary_blocks=4), torch.float32, "cpu")
    table = BlockTable(torch.device("cpu"))
    table.update(range(3))
    source_recorder = Recorder(pool, table)
    source_recorder.set_targets(((0, 0),))
    state = recording_state(config, pool, table, source_recorder, torch.float32, torch.device("cpu"))
    num_new = 40  # block end 16 lies 24 tokens before the write's end: beyond W + 8 ring rows
    for layer in state.layers:
        for store in layer.stores():
            store.mark_written(num_new)
    state.advance(num_new)
    restored_table = BlockTable(torch.device("cpu"))
    restored_table.update([0, 3])
    recorder = Recorder(pool, restored_table)
    restored = recording_state(config, pool, restored_table, recorder, torch.float32, torch.device("cpu"))
    with pytest.raises(KVPoolError, match="holds no"):
        restore_state(restored, recorder, BLOCK, 0)


if __name__ == "__main__":  # the interpreter child of test_kernel_path_snapshots_restore_under_interpreter
    from moemesh.bench.checks.attention import patch_interpreter_scalar_index

    patch_interpreter_scalar_index()
    for case in run_cases("cuda" if len(sys.argv) > 1 and sys.argv[1] == "cuda" else "cpu"):
        print(json.dumps(case), flush=True)
