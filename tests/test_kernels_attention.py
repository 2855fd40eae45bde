"""Batched attention kernels (sparse attention, indexer top-k, ring/row writes, window pooling)
against the per-sequence torch path, whole attention layers, under TRITON_INTERPRET=1 on CPU.

The interpreter is chosen when a kernel is decorated, so the cases run in one child process that
sets the variable before importing triton; one JSON line per case comes back (see
`bench.checks.attention`). Also: the dispatch rules of `default_attention_backend`.
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
CASE_IDS = ["indexer_scores", "rotate_back", "mixed_prefill_decode_verify", "few_rows_csa", "preallocated_rows",
            "paged_rows"]


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "moemesh.bench.checks.attention", "--suite", "interpret"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["case_id"]] = record
    if not results:
        pytest.fail(f"interpreter run produced no results (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


def test_every_case_ran(interpreted_results):
    assert sorted(interpreted_results) == sorted(CASE_IDS)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_kernel_path_matches_torch_path(interpreted_results, case_id):
    record = interpreted_results[case_id]
    assert record["all_finite"], record["name"]
    assert record["relative_error"] <= record["tolerance"], record


def test_backend_dispatch(monkeypatch):
    from moemesh.common.model.batch import AttentionBackend, default_attention_backend

    monkeypatch.delenv("MOEMESH_TORCH_ATTENTION", raising=False)
    assert default_attention_backend("cpu") is AttentionBackend.TORCH
    assert default_attention_backend(torch.device("cuda", 0)) is AttentionBackend.TRITON
    monkeypatch.setenv("MOEMESH_TORCH_ATTENTION", "1")
    assert default_attention_backend("cuda") is AttentionBackend.TORCH


def test_unaddressable_store_falls_back_to_torch():
    """A row store whose rows cannot be addressed in place gives no tables (torch path)."""
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import tiny_flash_like_config
    from moemesh.common.model.state import SequenceState

    class CopyingRowStore:  # read() returns a fresh copy: nothing to address
        def __init__(self) -> None:
            self.rows = torch.zeros(64, 32)

        def write(self, first_row, rows):
            self.rows[first_row: first_row + rows.shape[0]] = rows

        def read(self, num_rows):
            return self.rows[:num_rows].clone()

    config = tiny_flash_like_config((AttentionKind.WINDOW, AttentionKind.HCA))
    plain = SequenceState(config)
    batch = ForwardBatch([SequenceChunk(plain, 3)], "cpu", attention_backend=AttentionBackend.TRITON)
    assert batch.attention_tables is not None
    odd = SequenceState(config, row_store_factory=lambda layer, which, dim: CopyingRowStore())
    batch = ForwardBatch([SequenceChunk(odd, 3)], "cpu", attention_backend=AttentionBackend.TRITON)
    assert batch.attention_tables is None
