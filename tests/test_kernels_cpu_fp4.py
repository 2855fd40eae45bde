"""The native CPU FP4 kernel (common/kernels/cpu_fp4.c) against its torch references.

Every ISA variant the host can run is built (AVX-512, AVX2 via -mno-avx512f, scalar via -mno-avx2
...) and compared on random shapes: N not a multiple of the row tile, T = 1..33 (token tiles and
their remainders), K multiples of 32 (the format's block; K is always a multiple of every vector
width), fp32 and bf16 activations, special scale bytes (0 = 2^-127, 255 = NaN). The fused expert
call is compared with the per-expert reference and with `QuantizedRoutedExperts`' own torch path,
and `cpu_experts.expert_rows` on the native path with its torch path. Skips without a C compiler.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from moemesh.common.kernels import cpu_fp4
from moemesh.common.kernels.cpu_fp4 import BuildConfig, ExpertGroups, ExpertStacks, fp4_expert_reference, fp4_linear_reference
from moemesh.common.model.random_init import random_fp4_stack

COMPILER = cpu_fp4.find_compiler()
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


VARIANTS = {"native": (), "avx2": ("-mno-avx512f",), "scalar": ("-mno-avx2", "-mno-avx512f", "-mno-fma")}
EXPECTED_ISA = {"avx2": "avx2", "scalar": "scalar"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module", params=list(VARIANTS))
def native(request, cache_dir) -> cpu_fp4.NativeFp4:
    if request.param == "avx2" and not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("host has no AVX2/FMA")
    kernel = cpu_fp4.load_native(BuildConfig(COMPILER, VARIANTS[request.param], cache_dir))
    if request.param in EXPECTED_ISA:
        assert kernel.isa == EXPECTED_ISA[request.param]
    elif "avx512f" in _cpu_flags():
        assert kernel.isa == "avx512"
    return kernel


def _close(got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Equal up to fp32 summation order: error bounded relative to Σ|x||w| (the scale of rounding)."""
    bound = x.abs().to(torch.float32) @ weight.abs().T  # [T, N]
    assert torch.isfinite(got).all()
    assert bool(((got - expected).abs() <= 2e-6 * bound + 1e-30).all()), float((got - expected).abs().max())


@pytest.mark.parametrize("seed", range(6))
def test_linear_matches_reference(native, seed):
    """Both executors (seeds alternate) on 1-3 threads, every output written (poisoned beforehand)."""
    generator = torch.Generator().manual_seed(seed)
    num_out = int(torch.randint(1, 70, (1,), generator=generator))
    num_in = 32 * int(torch.randint(1, 12, (1,), generator=generator))
    for num_tokens in (1, 2, 3, 4, 5, 8, 17, 33):
        packed, scale = random_fp4_stack(1, num_out, num_in, generator=generator)
        x = torch.randn(num_tokens, num_in, generator=generator)
        out = torch.full((num_tokens, num_out), float("nan"))  # poisoned: every element must be written
        executor = cpu_fp4.Executor.OPENMP if seed % 2 else cpu_fp4.Executor.POOL
        got = native.linear(x, packed[0], scale[0], num_threads=1 + seed % 3, out=out, executor=executor)
        assert got.data_ptr() == out.data_ptr()
        expected = fp4_linear_reference(x, packed[0], scale[0])
        _close(got, expected, x, cpu_fp4.dequant_fp4(packed[0], scale[0]))


def test_linear_bf16_activations_and_int8_weights(native):
    generator = torch.Generator().manual_seed(11)
    packed, scale = random_fp4_stack(1, 37, 160, generator=generator)
    x = torch.randn(6, 160, generator=generator).to(torch.bfloat16)
    got = native.linear(x, packed[0].view(torch.int8), scale[0], num_threads=2)
    assert got.dtype == torch.float32
    expected = fp4_linear_reference(x, packed[0], scale[0])  # from the same bf16 values, in fp32
    _close(got, expected, x, cpu_fp4.dequant_fp4(packed[0], scale[0]))


def test_linear_special_scales(native):
    """Scale byte 0 is 2^-127 (a denormal factor, not 0), 254 is 2^127 (large codes overflow to inf, and
    inf times a zero input is NaN), 255 is NaN: wherever the reference has NaN, so does the kernel."""
    generator = torch.Generator().manual_seed(5)
    packed, scale = random_fp4_stack(1, 8, 64, generator=generator)
    packed, scale = packed[0], scale[0].clone()
    scale[0, :] = 0
    scale[1, 0] = 255
    scale[2, 1] = 254
    x = torch.randn(3, 64, generator=generator)
    x[0, 32:] = 0
    got = native.linear(x, packed, scale, num_threads=1)
    expected = fp4_linear_reference(x, packed, scale)
    assert torch.isnan(got[:, 1]).all() and torch.isnan(expected[:, 1]).all()
    assert (got[:, 0] != 0).all()  # 2^-127 scaled weights with x ~ 1 give tiny but nonzero sums
    assert torch.isnan(expected[0, 2]) or torch.isinf(expected[0, 2])
    assert torch.equal(torch.isnan(got), torch.isnan(expected)) and torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    bound = x.abs() @ cpu_fp4.dequant_fp4(packed, scale).abs().T  # [T, N]: the scale of rounding errors
    assert bool(((got - expected).abs()[finite] <= 2e-6 * bound[finite]).all())
    torch.testing.assert_close(got[:, 0], expected[:, 0], rtol=1e-3, atol=0)  # denormal weights not flushed


def test_linear_rejects_bad_shapes(native):
    packed, scale = random_fp4_stack(1, 4, 64)
    with pytest.raises(ValueError):
        native.linear(torch.randn(2, 96), packed[0], scale[0])
    with pytest.raises(ValueError):
        native.linear(torch.randn(2, 64), packed[0], scale[0][:, :1])


def _random_layer(generator, num_experts: int, hidden: int, inter: int):
    w1, s1 = random_fp4_stack(num_experts, inter, hidden, generator=generator)
    w3, s3 = random_fp4_stack(num_experts, inter, hidden, generator=generator)
    w2, s2 = random_fp4_stack(num_experts, hidden, inter, generator=generator)
    return w1, s1, w3, s3, w2, s2


@pytest.mark.parametrize("route_before_w2,limit,executor", [
    (False, None, cpu_fp4.Executor.POOL), (True, 0.5, cpu_fp4.Executor.POOL), (False, 0.5, cpu_fp4.Executor.OPENMP),
    (True, None, cpu_fp4.Executor.OPENMP)])
def test_experts_match_per_expert_reference(native, route_before_w2, limit, executor):
    """Rows grouped by expert (with a slot mask) through the fused call; each selected slot's row
    equals the reference expert on that token, unselected rows stay as they were."""
    generator = torch.Generator().manual_seed(21)
    num_experts, hidden, inter, num_tokens, top_k = 7, 96, 64, 13, 3
    tensors = _random_layer(generator, num_experts, hidden, inter)
    stacks = ExpertStacks.from_tensors(*tensors)
    x = torch.randn(num_tokens, hidden, generator=generator)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator)
    mask = torch.rand(num_tokens, top_k, generator=generator) < 0.7
    local = torch.arange(num_experts).flip(0)  # global expert e lives at stack index E-1-e
    groups = ExpertGroups.from_routing(ids, weights, mask, local)
    out = torch.full((num_tokens * top_k, hidden), 7.0)
    native.experts(x, groups, stacks, limit, route_before_w2, out, num_threads=3, executor=executor)
    flat_ids, flat_mask = ids.reshape(-1), mask.reshape(-1)
    for slot in range(num_tokens * top_k):
        if not flat_mask[slot]:
            assert bool((out[slot] == 7.0).all())
            continue
        index = int(local[flat_ids[slot]])
        w1, s1, w3, s3, w2, s2 = (t[index] for t in tensors)
        expected = fp4_expert_reference(x[slot // top_k][None], w1, s1, w3, s3, w2, s2, limit,
                                        weights.reshape(-1)[slot][None], route_before_w2)[0]
        torch.testing.assert_close(out[slot], expected, rtol=1e-4, atol=1e-5)


def test_pool_oversubscribed_and_resized(native):
    """The pool with more threads than cores and a thread count changing between calls (workers
    restarted): every call equals the single-threaded one exactly (each output is one thread's sum
    over all of K, so the thread split does not change the value)."""
    generator = torch.Generator().manual_seed(9)
    tensors = _random_layer(generator, 4, 128, 96)
    stacks = ExpertStacks.from_tensors(*tensors)
    x = torch.randn(5, 128, generator=generator)
    ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(5)])
    groups = ExpertGroups.from_routing(ids, torch.rand(5, 2, generator=generator), None, torch.arange(4))
    expected = native.experts(x, groups, stacks, 1.0, False, torch.zeros(10, 128), num_threads=1)
    for num_threads in (8, 3, 8, 1, 16):
        for _ in range(3):
            out = torch.full((10, 128), float("nan"))
            native.experts(x, groups, stacks, 1.0, False, out, num_threads=num_threads, executor=cpu_fp4.Executor.POOL)
            assert torch.equal(out, expected), num_threads


@pytest.mark.parametrize("masked", [False, True])
def test_routed_experts_equal_grouped_call(native, masked):
    """The grouping done in C gives bit for bit the outputs of the call on `ExpertGroups.from_routing`
    (same rows, same order; every output is one tile's sum over all of K)."""
    generator = torch.Generator().manual_seed(13)
    tensors = _random_layer(generator, 6, 64, 32)
    stacks = ExpertStacks.from_tensors(*tensors)
    num_routed, num_tokens, top_k = 12, 7, 4
    local = torch.full((num_routed,), 99)
    held_ids = torch.tensor([1, 3, 4, 7, 10, 11])
    local[held_ids] = torch.arange(6)
    x = torch.randn(num_tokens, 64, generator=generator)
    ids = held_ids[torch.stack([torch.randperm(6, generator=generator)[:top_k] for _ in range(num_tokens)])]
    weights = torch.rand(num_tokens, top_k, generator=generator)
    mask = (torch.rand(num_tokens, top_k, generator=generator) < 0.6) if masked else None
    expected = torch.full((num_tokens * top_k, 64), -3.0)
    native.experts(x, ExpertGroups.from_routing(ids, weights, mask, local), stacks, 2.0, False, expected, 2)
    got = torch.full((num_tokens * top_k, 64), -3.0)
    native.routed_experts(x, ids, weights, mask, local, stacks, 2.0, False, got, 2)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="outside"):
        native.routed_experts(x, ids + 20, weights, None, local, stacks, 2.0, False, got, 2)


def test_expert_groups_order():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    groups = ExpertGroups.from_routing(ids, torch.rand(3, 2), mask, torch.arange(4) + 10)
    assert groups.stack_ids.tolist() == [11, 12, 13]  # experts 1, 2, 3 ascending (0 is masked)
    assert groups.offsets.tolist() == [0, 2, 3, 5]
    assert groups.row_dest.tolist() == [1, 2, 5, 0, 4]  # each expert's slots ascending
    assert groups.row_tokens.tolist() == [0, 1, 2, 0, 2]


def _worker_config():
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import flash_config

    return flash_config([AttentionKind.CSA], hidden_size=256, moe_intermediate_size=128, n_routed_experts=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_rows_native_equals_quantized_routed_experts(dtype):
    """The worker's CPU path on the native kernel against `QuantizedRoutedExperts`' torch path and the
    torch-block path of `expert_rows`, on the same held bytes (half the experts held, a slot mask)."""
    from moemesh.common.model.quantized import KernelBackend
    from moemesh.common.model.quantized_experts import QuantizedRoutedExperts
    from moemesh.common.model.cpu_experts import CpuBlockRunner, expert_rows
    from moemesh.bench.hostwork import random_held_experts

    config = _worker_config()
    pairs = [(0, e) for e in range(0, 16, 2)]
    experts = random_held_experts(config, pairs, "cpu", seed=4)
    held = experts._layers[0]
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 256, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(16, generator=generator)[:6] for _ in range(9)]).sort(dim=1).values
    weights = torch.rand(9, 6, generator=generator)
    selected = ids % 2 == 0
    native_runner = CpuBlockRunner(2, use_native=True)
    got = expert_rows(held, hidden, ids, weights, selected, config.swiglu_limit, False, native_runner)
    assert got.dtype == dtype
    torch_path = expert_rows(held, hidden, ids, weights, selected, config.swiglu_limit, False,
                             CpuBlockRunner(1, use_native=False))
    tensors = [getattr(held, n) for n in ("w1", "s1", "w2", "s2", "w3", "s3")]
    reference = QuantizedRoutedExperts({0: (held.expert_ids, tensors)}, 16, config.swiglu_limit,
                                       backend=KernelBackend.TORCH)
    expected = reference.per_expert_outputs(0, hidden.float(), ids, weights, selected)
    assert bool((got[~selected] == 0).all())
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(got.float(), expected, **tolerance)
    if dtype == torch.float32:
        torch.testing.assert_close(got, torch_path, **tolerance)
    else:  # the torch path rounds its intermediates to bf16; the kernel keeps them in fp32
        assert float((got.float() - torch_path.float()).norm() / torch_path.float().norm()) < 1e-2


def test_runner_linear_native_equals_blocked():
    from moemesh.common.model.cpu_experts import CpuBlockRunner, fp4_linear, fp4_linear_blocked

    generator = torch.Generator().manual_seed(8)
    packed, scale = random_fp4_stack(1, 70, 192, generator=generator)
    x = torch.randn(5, 192, generator=generator)
    out = torch.empty(5, 70)
    runner = CpuBlockRunner(2, use_native=True)
    runner.linear([(out, x, packed[0], scale[0])])
    expected = fp4_linear_blocked(x, packed[0], scale[0])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp4_linear(x, packed[0], scale[0], runner), expected, rtol=1e-5, atol=1e-5)
    bf16 = fp4_linear(x.bfloat16(), packed[0], scale[0], runner)  # written through an fp32 result
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp4_linear_reference(x.bfloat16(), packed[0], scale[0]),
                               rtol=1e-2, atol=1e-2)


def test_env_forces_torch_and_missing_compiler_falls_back(monkeypatch):
    from moemesh.common.model.cpu_experts import CpuBlockRunner

    monkeypatch.setenv(cpu_fp4.KERNEL_ENV, "torch")
    assert cpu_fp4.native_kernel() is None and "torch" in cpu_fp4.unavailable_reason()
    assert CpuBlockRunner(2).native is None
    monkeypatch.delenv(cpu_fp4.KERNEL_ENV)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_fp4.native_kernel() is None
    assert "/nonexistent/cc" in cpu_fp4.unavailable_reason()
    runner = CpuBlockRunner(2)
    assert runner.native is None and runner._pool is not None  # the torch pool path
    runner.close()
    monkeypatch.delenv("CC")
    assert cpu_fp4.native_kernel() is not None


def test_build_is_cached_and_safe_under_concurrency(tmp_path):
    """Four threads building into one empty cache: one file results, each loads; a later build reuses it."""
    config = BuildConfig(COMPILER, ("-DMOEMESH_TEST_VARIANT=1",), tmp_path)
    paths, errors = [], []

    def build():
        try:
            paths.append(cpu_fp4.build_library(config))
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no temporary files left
    built_at = paths[0].stat().st_mtime_ns
    assert cpu_fp4.build_library(config) == paths[0] and paths[0].stat().st_mtime_ns == built_at
    assert cpu_fp4.NativeFp4(paths[0]).isa in ("avx512", "avx2", "scalar")


def test_build_failure_raises_with_compiler_output(tmp_path):
    with pytest.raises(cpu_fp4.NativeBuildError, match="failed"):
        cpu_fp4.build_library(BuildConfig(COMPILER, ("-DMOEMESH_X=1", "-fno-such-flag-here"), tmp_path))


def test_unwritable_cache_dir_falls_back_to_tmp(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MOEMESH_CACHE_DIR", str(blocker))  # <file>/kernels cannot be created
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    path = cpu_fp4.build_library(BuildConfig(COMPILER, ("-DMOEMESH_TEST_VARIANT=2",)))
    assert path.parent.parent == tmp_path / "tmp" and path.exists()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_pool_works_in_a_forked_child(native):
    """A child forked after the pool started has none of its workers: it starts its own, same results."""
    import os

    generator = torch.Generator().manual_seed(2)
    packed, scale = random_fp4_stack(1, 40, 96, generator=generator)
    x = torch.randn(3, 96, generator=generator)
    expected = native.linear(x, packed[0], scale[0], 4, executor=cpu_fp4.Executor.POOL)
    pid = os.fork()
    if pid == 0:  # the child: exit code says whether both calls (new workers, then resized) agree
        same = all(torch.equal(native.linear(x, packed[0], scale[0], n, executor=cpu_fp4.Executor.POOL), expected)
                   for n in (4, 3))
        os._exit(0 if same else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_fullsize_cpu_bench_runs(tmp_path):
    """bench.fullsize_cpu at true width on a few experts: every path gives a row with sane figures."""
    import json

    from moemesh.bench import fullsize_cpu

    code = fullsize_cpu.main(["--threads", "1", "--tokens", "1", "--num-experts", "6", "--top-k", "2", "--reps", "1",
                              "--copy-bytes", "4000000", "--paths", "native,native_omp,native_per_expert",
                              "--out-dir", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("fullsize-cpu-*.json")
    rows = json.loads(path.read_text())["raw"]["rows"]
    assert [r["path"] for r in rows] == ["native", "native_omp", "native_per_expert"]
    for row in rows:
        assert row["experts_touched"] == 2 and row["s"] > 0 and row["weight_read_bytes_per_s"] > 0
