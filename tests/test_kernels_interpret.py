"""Triton kernels against their references under TRITON_INTERPRET=1 on CPU, small sizes.

The interpreter is chosen when a kernel is decorated, so the cases run in one child process that
sets the variable before importing triton (this process may import the compiled kernels for the
CUDA tests). One JSON line per case comes back; each case is a test here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO_ROOT = Path(__file__).resolve().parent.parent
CASE_IDS = [
    "fp8_decode_ragged", "fp8_split3_bk64", "fp8_prefill_fp32", "fp8_bf16_out",
    "fp4_experts_clamp", "fp4_experts_noclamp_fp32", "fp8_experts_clamp", "fp8_experts_fp32_default_cfg",
    "fp4_halves_split2_fma_split2", "fp4_fma_halves_fp32", "fp8_experts_split2",
    "fp8_fma_t1_split2", "fp8_fma_t4_bf16_out", "fp8_experts_fma_m2",
    "fp4_decode_exact_join", "fp4_decode_exact_halves", "fp4_fma_m1_fma_m2_split2",
]


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "moemesh.bench.checks.quantized_kernels", "--suite", "interpret"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["case_id"]] = record
    if not results:
        pytest.fail(f"interpreter run produced no results (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    results["_returncode"] = proc.returncode
    return results


def test_every_case_ran(interpreted_results):
    assert sorted(k for k in interpreted_results if not k.startswith("_")) == sorted(CASE_IDS)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_kernel_matches_reference(interpreted_results, case_id):
    record = interpreted_results.get(case_id)
    assert record is not None, f"{case_id} did not run"
    assert record["all_finite"], record["name"]
    assert record["relative_error"] <= record["tolerance"], record
