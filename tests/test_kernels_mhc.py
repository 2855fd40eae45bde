"""Fused mHC kernels (common/kernels/mhc.py, mhc_streams.py) against the torch code of common/model/hyper.py.

CPU: the kernels under TRITON_INTERPRET=1 at tiny sizes, in one child process (the interpreter is
chosen when a kernel is decorated, and this process may hold the compiled kernels). CUDA: V4-Flash
sizes through the model's dispatching functions (skips without a GPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moemesh.bench.checks import glue_kernel_runs, glue_kernels  # noqa: E402

ONLY = "mhc"
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


def test_interpreted_fp32_hc_pre_is_tight(interpreted):
    for case_id in ("hc_pre_n4", "hc_pre_n2_ragged", "hc_pre_n3_padded"):
        assert interpreted[case_id]["relative_error"] < 1e-6, interpreted[case_id]
        assert interpreted[case_id]["fp32_error"] < 1e-6, interpreted[case_id]


def test_sinkhorn_of_kernel_is_doubly_stochastic(interpreted):
    """20 iterations on the Flash stream count: rows and columns sum to 1 within 1e-4 (hc_eps shifts them)."""
    record = interpreted["hc_pre_n4"]
    assert record["stochastic_error"] < 1e-4, record


def test_cpu_tensors_take_the_torch_path():
    from moemesh.common.kernels.glue import forced_torch_glue, use_triton_glue

    x = torch.zeros(2)
    assert not use_triton_glue(x)
    with forced_torch_glue(False):
        assert not use_triton_glue(x)


def test_code_traced_by_torch_compile_takes_the_torch_path(monkeypatch):
    from moemesh.common.kernels.glue import INTERPRET_ON_CPU_ENV, TORCH_GLUE_ENV, use_triton_glue

    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(TORCH_GLUE_ENV, raising=False)
    x = torch.zeros(2)
    assert use_triton_glue(x)  # the interpreter's rule for CPU tensors, outside a trace

    def which_path(t: torch.Tensor) -> torch.Tensor:
        return t + 1.0 if use_triton_glue(t) else t - 1.0

    torch._dynamo.reset()
    assert torch.equal(torch.compile(which_path, backend="eager", fullgraph=True)(x), x - 1.0)


def test_torch_glue_switch(monkeypatch):
    from moemesh.common.kernels.glue import TORCH_GLUE_ENV, forced_torch_glue, torch_glue_forced

    monkeypatch.delenv(TORCH_GLUE_ENV, raising=False)
    assert not torch_glue_forced()
    with forced_torch_glue():
        assert torch_glue_forced()
    assert not torch_glue_forced()
    monkeypatch.setenv(TORCH_GLUE_ENV, "1")
    assert torch_glue_forced()
    monkeypatch.setenv(TORCH_GLUE_ENV, "0")
    assert not torch_glue_forced()


def test_choose_mix_config_covers_the_columns():
    from moemesh.common.kernels import mhc

    device = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        for num_tokens in (1, 8, 64, 2048, 8192):
            config = mhc.choose_mix_config(num_tokens, 16384, device, dtype)
            assert config.num_splits & (config.num_splits - 1) == 0
            assert 16384 // config.num_splits >= config.block_k  # at least one K step per program
            assert config.precision != "bf16x3" or dtype == torch.bfloat16


def test_bf16x3_needs_bf16_streams():
    from moemesh.common.kernels import mhc

    config = mhc.MixConfig(block_t=16, block_k=16, num_splits=1, block_d=32, precision="bf16x3")
    with pytest.raises(ValueError):
        mhc.hc_pre(torch.zeros(1, 4, 8), torch.zeros(24, 32), torch.zeros(24), torch.ones(3), 20, 1e-6, 1e-6,
                   config=config)
    with pytest.raises(ValueError):
        mhc.MixConfig(block_t=1, block_k=16, num_splits=1, block_d=32, precision="bf16x3")


def test_kernels_compile_for_hopper():
    """ptxas for sm_90 on this machine: what the interpreter accepts must also compile for the GPU."""
    errors = glue_kernel_runs.hopper_compile_errors("mhc")
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


@cuda
@pytest.mark.cuda
def test_cuda_hc_pre_post_capture_in_a_graph():
    """Both launches of hc_pre and hc_post replay in a CUDA graph and give the eager result."""
    from moemesh.common.model import hyper

    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(2, 4, 4096, generator=g, device="cuda").bfloat16()
    fn = torch.randn(24, 16384, generator=g, device="cuda") / 64
    base, scale = torch.randn(24, generator=g, device="cuda"), torch.rand(3, generator=g, device="cuda") + 0.5
    y = torch.randn(2, 4096, generator=g, device="cuda").bfloat16()
    eager_x, eager_post, eager_comb = hyper.hc_pre(h, fn, base, scale, 20, 1e-6, 1e-6)
    eager = hyper.hc_post(y, h, eager_post, eager_comb)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        hyper.hc_post(y, h, *hyper.hc_pre(h, fn, base, scale, 20, 1e-6, 1e-6)[1:])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x, post, comb = hyper.hc_pre(h, fn, base, scale, 20, 1e-6, 1e-6)
        out = hyper.hc_post(y, h, post, comb)
    h.copy_(torch.randn(2, 4, 4096, generator=g, device="cuda").bfloat16())
    expected_x, _, _ = hyper.hc_pre(h, fn, base, scale, 20, 1e-6, 1e-6)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, expected_x)
    assert not torch.equal(x, eager_x)
    assert torch.isfinite(out).all() and out.shape == eager.shape
