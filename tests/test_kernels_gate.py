"""The one-launch MoE gate (common/kernels/gate.py) against `Gate`'s torch path (common/model/moe.py).

CPU: the kernel under TRITON_INTERPRET=1 at small sizes (one child process, bench/checks/gate_kernel.py):
learned and hash routing, random / zero / no bias, fp32 and bf16, every launch path, the tie rule, and
`Gate.forward`'s dispatch. sm_90 compilation of the V4-Flash variants. CUDA: V4-Flash sizes (E 256,
D 4096, K 6, bf16) through `Gate`, and a CUDA-graph replay (skip without a GPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moemesh.bench.checks import gate_kernel, glue_kernel_runs  # noqa: E402

INTERPRET_IDS = [case_id for case_id, _ in gate_kernel.interpret_cases()]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    records, stderr = glue_kernel_runs.run_interpret_suite(None, module="moemesh.bench.checks.gate_kernel")
    if not records:
        pytest.fail(f"interpreter run produced no results ({stderr})")
    return records


@pytest.mark.parametrize("case_id", INTERPRET_IDS)
def test_interpreted_kernel_matches_gate(interpreted, case_id):
    record = interpreted.get(case_id)
    assert record is not None, f"{case_id} did not run"
    assert record["passed"], record


def test_interpreted_bf16_weights_are_bit_equal(interpreted):
    """From equal logits the kernel reproduces every bf16 rounding of the reference."""
    for case_id, record in interpreted.items():
        if "bf16" in case_id:
            assert record["bit_equal_weights"] == 1.0, record


def test_gate_torch_path_breaks_ties_to_the_lowest_id():
    """The CPU reference's rule, which the kernel follows (torch.topk's on CUDA)."""
    module = gate_kernel.make_gate(8, 4, 3, False, torch.float32, "cpu")
    module.weight.copy_(torch.tensor([[0.0] * 4, [1.0] * 4, [0.5] * 4, [0.5] * 4,
                                      [0.5] * 4, [-1.0] * 4, [1.0] * 4, [0.5] * 4]))
    module.bias.zero_()
    ids, weights = module(torch.ones(2, 4), torch.zeros(2, dtype=torch.long))
    assert ids.tolist() == [[1, 2, 6], [1, 2, 6]]
    torch.testing.assert_close(weights.sum(-1), torch.full((2,), gate_kernel.ROUTE_SCALE))


def test_kernel_compiles_for_hopper():
    """ptxas for sm_90 on this machine (libdevice calls, the last-program branch, tl.dot shapes)."""
    errors = gate_kernel.hopper_compile_errors(((1, False), (64, True), (2048, False)))
    assert errors and not any(errors.values()), errors


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_CASES = gate_kernel.cuda_cases()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=[case_id for case_id, _ in CUDA_CASES])
def test_cuda_kernel_matches_gate_at_flash_size(case):
    _, run_case = case
    result = run_case()
    assert result.passed, result
    torch.cuda.empty_cache()
