"""Decode steps through static device metadata (services/attention/graph_decode.py, graph_tables.py) on CPU.

The whole-model check runs the metadata path (static tables, predicated window closes, split sizes
from device memory, indexer width classes) with the Triton kernels under TRITON_INTERPRET=1 against
ModelRunner's eager torch path, over decode steps with sequences joining and leaving and windows of
both ratios closing (`bench.checks.decode_graphs`, one child process: the interpreter is chosen
at import). The others check the host side: eligibility, width classes and the tables' contents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_side():
    from moemesh.common.model.random_init import random_model
    from moemesh.bench.checks.decode_graphs import tiny_graph_config

    config = tiny_graph_config()
    side, _ = random_model(config, "cpu")
    return config, side


def test_metadata_path_matches_eager_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "moemesh.bench.checks.decode_graphs", "--suite", "interpret"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400)
    from moemesh.bench.checks.decode_graphs import INTERPRET_CASES, prefill_counts

    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert records, f"no results (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    assert [record["case_id"] for record in records] == ["join_leave_windows", "verify_chunks", "paged_rows"]
    for record, case in zip(records, INTERPRET_CASES):
        short, long = prefill_counts(case)  # prompts of at most 8 tokens are short chunks: the metadata path
        assert record["num_graph_steps"] == case.num_decode_steps + short, record  # every decode / verify step too
        assert record["eager_reasons"] == ({"chunk_too_long": long} if long else {}), record  # longer prompts not
        assert record["max_relative_error"] < 1e-5, record
        assert record["state_relative_error"] < 1e-5, record
        assert record["num_token_mismatches"] == 0, record


def test_index_rows_class():
    from moemesh.services.attention.graph_tables import index_rows_class

    assert index_rows_class(0, 512) is None
    assert index_rows_class(512, 512) is None
    assert index_rows_class(513, 512) == 2048
    assert index_rows_class(2049, 512) == 4096
    assert index_rows_class(3, 2) == 8
    assert index_rows_class(9, 2) == 16


def _chunks(states):
    from moemesh.common.model.batch import SequenceChunk

    return [(torch.zeros(len(states), dtype=torch.long), [SequenceChunk(s, 1) for s in states])]


def test_plan_keys_and_eager_reasons(tiny_side):
    from moemesh.common.model.batch import SequenceChunk
    from moemesh.common.model.state import SequenceState
    from moemesh.services.attention.graph_decode import DecodeGraphConfig, DecodeGraphs

    config, side = tiny_side
    graphs = DecodeGraphs(side, DecodeGraphConfig(buckets=(1, 2, 4), capture=False), "cpu")
    states = [SequenceState(config) for _ in range(3)]
    for state, count in zip(states, (5, 12, 40)):
        state.commit_kernel_writes(count)  # positions only matter here
    keys = graphs.plan(_chunks(states))
    assert keys is not None
    index, bucket, index_rows, (paged, _) = keys[0]
    assert (index, bucket, index_rows, paged) == (0, 4, 16, False)  # 41 // 4 = 10 rows > top-k 2 -> 16
    assert graphs.plan(_chunks(states + [SequenceState(config) for _ in range(2)])) is None
    verify = [(torch.zeros(3, dtype=torch.long), [SequenceChunk(states[0], 2), SequenceChunk(states[1], 1)])]
    assert graphs.plan(verify)[0][1] == 4  # chunks of several tokens: the bucket counts tokens
    prefill = [(torch.zeros(9, dtype=torch.long), [SequenceChunk(states[0], 9)])]
    assert graphs.plan(prefill) is None
    too_many = [(torch.zeros(5, dtype=torch.long), [SequenceChunk(states[0], 3), SequenceChunk(states[1], 2)])]
    assert graphs.plan(too_many) is None
    assert graphs.stats.eager_reasons == {"batch_above_buckets": 2, "chunk_too_long": 1}


def test_tables_fill_matches_eager_tables(tiny_side):
    """Positions, per-sequence fields, padding rows and the split sizes the eager launch would plan."""
    from moemesh.common.model.attention_tables import build_tables, sequence_addresses
    from moemesh.common.kernels.sparse_attention_plan import default_config, max_keys_of, plan_splits
    from moemesh.common.model.state import SequenceState
    from moemesh.services.attention.graph_tables import StaticDecodeTables, split_keys

    config, side = tiny_side
    states = [SequenceState(config) for _ in range(3)]
    for state, count in zip(states, (5, 12, 40)):
        state.commit_kernel_writes(count)
        state.reserve_tokens(count + 1)
    scratch = SequenceState(config)
    first = sequence_addresses(states[0])
    tables = StaticDecodeTables(config, 4, dict(first.rows_per_block), 1, 16, torch.float32, torch.device("cpu"))
    tables.fill(states, torch.tensor([7, 8, 9]), scratch)
    assert tables.positions.tolist() == [5, 12, 40, 0]
    assert tables.seq_info.tolist() == [[5, 0, 1], [12, 1, 1], [40, 2, 1], [0, 3, 1]]
    assert tables.token_ids.tolist() == [7, 8, 9, 0]
    for index, state in enumerate(states + [scratch]):
        assert torch.equal(tables.fields[:, index], sequence_addresses(state).fields)
    eager = build_tables(config, states, [5, 12, 40], [1, 1, 1], torch.tensor([5, 12, 40]))
    for key, size in zip(split_keys(config), tables.split_sizes.tolist()):
        max_keys = max_keys_of(eager, key.window, key.ratio, key.topk)
        assert size == plan_splits(3, config.num_attention_heads, max_keys, default_config(3)).keys_per_split
    assert tables.max_rows_visible(config.csa_compress_ratio) == 16
    assert tables.closing_tokens(config.csa_compress_ratio)[1] == 4  # every row: closes are predicated


def test_tables_fill_chunks_of_several_tokens(tiny_side):
    """Verification chunks: every token gets its sequence and position; padding rows are scratch sequences of one
    token; the sequence entries past them are empty; split sizes are the eager plan of the real tokens."""
    from moemesh.common.model.attention_tables import build_tables, sequence_addresses
    from moemesh.common.kernels.sparse_attention_plan import default_config, max_keys_of, plan_splits
    from moemesh.common.model.state import SequenceState
    from moemesh.services.attention.graph_tables import StaticDecodeTables, split_keys

    config, _ = tiny_side
    states = [SequenceState(config) for _ in range(2)]
    for state, count in zip(states, (5, 30)):
        state.commit_kernel_writes(count)
        state.reserve_tokens(count + 4)
    scratch = SequenceState(config)
    first = sequence_addresses(states[0])
    tables = StaticDecodeTables(config, 8, dict(first.rows_per_block), 1, 16, torch.float32, torch.device("cpu"),
                                min_real_tokens=5)
    tables.fill(states, torch.arange(10, 16), scratch, [4, 2])
    assert tables.positions.tolist() == [5, 6, 7, 8, 30, 31, 0, 0]
    assert tables.token_seq.tolist() == [0, 0, 0, 0, 1, 1, 2, 3]
    assert tables.token_seq.dtype == torch.int32
    assert tables.seq_info.tolist() == [[5, 0, 4], [30, 4, 2], [0, 6, 1], [0, 7, 1]] + [[0, 0, 0]] * 4
    assert tables.token_ids.tolist() == [10, 11, 12, 13, 14, 15, 0, 0]
    for index in range(2, 8):
        assert torch.equal(tables.fields[:, index], sequence_addresses(scratch).fields)
    eager = build_tables(config, states, [5, 30], [4, 2], torch.tensor([5, 6, 7, 8, 30, 31]))
    for key, size in zip(split_keys(config), tables.split_sizes.tolist()):
        max_keys = max_keys_of(eager, key.window, key.ratio, key.topk)
        assert size == plan_splits(6, config.num_attention_heads, max_keys, default_config(6)).keys_per_split
    with pytest.raises(ValueError, match="9 tokens"):
        tables.fill(states, None, scratch, [5, 4])


def test_commit_kernel_writes_advances_every_store(tiny_side):
    from moemesh.common.model.state import SequenceState

    config, _ = tiny_side
    state = SequenceState(config)
    state.commit_kernel_writes(3)
    assert state.num_tokens == 3
    assert all(store.num_tokens == 3 for layer in state.layers for store in layer.stores())
    state.rollback(2)
    assert state.num_tokens == 1
