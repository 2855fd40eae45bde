"""Triton kernels against their references at V4-Flash sizes on CUDA (skips without a GPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

triton = pytest.importorskip("triton")

from moemesh.bench.checks import quantized_kernels  # noqa: E402

CASES = quantized_kernels.cuda_cases()


@pytest.mark.parametrize("case", CASES, ids=[case_id for case_id, _ in CASES])
def test_kernel_matches_reference_at_real_size(case):
    _, run_case = case
    result = run_case()
    assert result.all_finite, result.name
    assert result.relative_error <= result.tolerance, result
    torch.cuda.empty_cache()
