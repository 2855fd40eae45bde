"""The prefill paths against the fp32 references (`bench/checks/prefill.py`): routed experts by
dequantising a chunk of FP4 experts to bf16 + grouped GEMMs (`fp4_prefill.py`), FP8 linears by a transient
bf16 weight + cuBLAS (`fp8_dequant.py`). Under TRITON_INTERPRET=1 on CPU at small sizes (a child process:
the interpreter is chosen when a kernel is decorated), and at V4-Flash sizes on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _records(stdout: str) -> dict[str, dict]:
    return {r["case_id"]: r for r in (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))}


def test_interpreted_dequant_exact_and_path_matches_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "moemesh.bench.checks.prefill", "--device", "cpu"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    records = _records(proc.stdout)
    assert set(records) == {"dequant_exact", "dequant_path_chunks", "fp8_dequant_exact_ragged",
                            "fp8_linears_dequant_path"}, proc.stderr[-3000:]
    assert all(r["passed"] for r in records.values()), records


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flash_width():
    from moemesh.bench.checks.prefill import cases

    for case_id, run in cases("cuda"):
        result = run()
        assert result.passed, (case_id, result)


def test_prefer_dequant_path_rule():
    from moemesh.common.kernels.fp4_prefill import MIN_MEAN_ROWS_PER_EXPERT, prefer_dequant_path

    assert not prefer_dequant_path(6, 256)  # decode
    assert prefer_dequant_path(MIN_MEAN_ROWS_PER_EXPERT * 256, 256) == hasattr(torch, "_grouped_mm")
    assert not prefer_dequant_path(MIN_MEAN_ROWS_PER_EXPERT * 256 - 1, 256)


def test_fp8_path_rule(monkeypatch):
    from moemesh.common.kernels.fp8_dequant import MIN_TOKENS, PATH_ENV, use_dequant_linear

    monkeypatch.delenv(PATH_ENV, raising=False)
    assert not use_dequant_linear(MIN_TOKENS - 1) and use_dequant_linear(MIN_TOKENS)  # auto
    monkeypatch.setenv(PATH_ENV, "kernel")
    assert not use_dequant_linear(10 * MIN_TOKENS)
    monkeypatch.setenv(PATH_ENV, "dequant")
    assert use_dequant_linear(1)
