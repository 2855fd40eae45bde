"""Fused RMS norm / RoPE kernels (common/kernels/norm_rope.py) against common/model/{linear,rope}.py.

CPU: the kernels under TRITON_INTERPRET=1 at tiny sizes (one child process); the model functions'
torch path on CPU. CUDA: V4-Flash sizes through the dispatching model functions (skips without a GPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moemesh.bench.checks import glue_kernel_runs, glue_kernels  # noqa: E402
from moemesh.common.model import linear, rope  # noqa: E402

ONLY = "norm"
INTERPRET_IDS = [case_id for case_id, _ in glue_kernels.interpret_cases(ONLY)]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    records, stderr = glue_kernel_runs.run_interpret_suite(ONLY)
    if not records:
        pytest.fail(f"interpreter run produced no results ({stderr})")
    return records


@pytest.mark.parametrize("case_id", INTERPRET_IDS)
def test_interpreted_kernel_matches_torch(interpreted, case_id):
    record = interpreted.get(case_id)
    assert record is not None, f"{case_id} did not run"
    assert record["passed"], record


def test_interpreted_fp32_is_tight(interpreted):
    for case_id, record in interpreted.items():
        if case_id.endswith("_f32"):
            assert record["relative_error"] < 1e-6, record


def test_fused_torch_functions_equal_the_two_step_code():
    """On CPU rms_norm_rope / inverse_rope are exactly the unfused calls they replace."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 32, generator=g).bfloat16()
    angles = torch.randn(3, 8, generator=g) * 50
    cos, sin = angles.cos(), angles.sin()
    norm = linear.RMSNorm(32, 1e-6)
    norm.weight.data.copy_(torch.rand(32, generator=g) + 0.5)
    unweighted = linear.unweighted_rms_norm(x, 1e-6)
    assert torch.equal(rope.rms_norm_rope(x, cos, sin, 1e-6), rope.apply_rope(unweighted, cos, sin))
    assert torch.equal(rope.rms_norm_rope(x, cos, sin, 1e-6, norm.weight), rope.apply_rope(norm(x), cos, sin))
    assert torch.equal(rope.inverse_rope(x, cos, sin), rope.apply_rope(x, cos, -sin))
    back = rope.inverse_rope(rope.apply_rope(x.float(), cos, sin), cos, sin)
    torch.testing.assert_close(back, x.float(), atol=1e-4, rtol=1e-4)



def test_kernels_compile_for_hopper():
    """ptxas for sm_90 on this machine: what the interpreter accepts must also compile for the GPU."""
    errors = glue_kernel_runs.hopper_compile_errors("norm")
    assert errors and not any(errors.values()), errors

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_CASES = glue_kernels.cuda_cases(ONLY)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=[case_id for case_id, _ in CUDA_CASES])
def test_cuda_kernel_matches_torch_at_flash_size(case):
    _, run_case = case
    result = run_case()
    assert result.passed, result
    torch.cuda.empty_cache()
