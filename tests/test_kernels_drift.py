"""bf16 drift of the quantized model under TRITON_INTERPRET=1 (CPU): the FP8/FP4 kernels against an
fp32 run of the same weights, bounded by the torch bf16 path's own drift (`bench/kernels_drift.py`).

The interpreter is patched to round fp32 -> bf16 stores to nearest even, as compiled kernels do
(its own cast truncates); the first test checks that patch, the second the model-level bound with
hash routing (no top-k selection can flip, so only rounding is compared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def drift() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "moemesh.bench.kernels_drift", "--device", "cpu", "--routing", "hash", "--seeds", "3",
         "--num-prefill", "24", "--num-decode", "2", "--skip-ops", "--json"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_interpreter_rounds_bf16_stores_to_nearest_even(drift):
    assert drift["bf16_store_rounding_agreement"] == 1.0


def test_kernel_drift_bounded_by_torch_bf16_drift(drift):
    (model,) = drift["models"].values()
    assert all(c == 0 for counts in model["routing_flips_vs_fp32"].values() for c in counts)
    assert len(model["rows"]) == 2 * (2 * 3 + 1)  # prefill/decode x (attn, ffn per layer + logits)
    for row in model["rows"]:
        assert 0 < row["torch_vs_fp32"] < 0.05, row
        assert row["kernel_vs_fp32"] <= 1.25 * row["torch_vs_fp32"] + 1e-3, row
