"""The tiny model's forward with every glue op (mHC, norms, RoPE) on the Triton path, interpreted on CPU.

A child process sets TRITON_INTERPRET=1 and MOEMESH_TRITON_GLUE_ON_CPU=1, so each dispatch site in
the model (hyper, RMSNorm, apply_rope, the attention's q / kv / inverse rotation, the compressors,
the indexer) runs its kernel, and compares the logits with transformers on the same weights.
Slow: the interpreter runs each program in numpy (~30-60 s on a 2-core machine).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from moemesh.bench.checks import glue_kernel_runs  # noqa: E402

TOLERANCE = 1e-4  # the torch path's bound in tests/test_model_forward.py


@pytest.mark.slow
def test_tiny_model_through_the_kernels_matches_transformers():
    records, stderr = glue_kernel_runs.run_interpret_suite(None, timeout_s=400, suite="model")
    record = records.get("model_forward")
    assert record is not None, stderr
    assert record["triton_path"], record
    assert record["all_finite"], record
    assert record["max_abs_logit_diff"] < TOLERANCE, record
