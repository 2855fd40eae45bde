"""Decode-step kernels that replace torch glue around the attention block and the shared expert, against the torch
code they replace:
- `fp8_linear.fp8_gate_up_swiglu` / `SharedExpert`: gate + up + SwiGLU in one launch (then w2);
- `projections.compressor_projections` / `Compressor.project` / `Indexer.project_inputs`: a module's bf16
  projections (K, Z + ape, the indexer's head weights) in one launch;
- `indexer_topk.top_k_columns`: the indexer's top-k in one launch at decode sizes;
- `norm_rope.rope_cos_sin` / `norm_rope.window_rows_norm_rope` (`RotaryTable.cos_sin`, `window_rows_norm_rope`).

CPU: the kernels under TRITON_INTERPRET=1 at small sizes (`test_interpreted_*`: run here when this process
interprets, else in one child process that does). CUDA: V4-Flash sizes and CUDA-graph replays (skip without a
GPU, and under the interpreter).

Tolerances, and why:
- bf16 results that round the same fp32 products as the torch code (gate/up/SwiGLU, the FP8 kernel's tiles are
  `fp8_linear`'s own): equal bit for bit in the interpreter; on the GPU at least 99.9 % bit-equal and the rest
  within two bf16 units in the last place (ulp), room for libdevice's expf against torch's (a silu one ulp off
  moves the rounded product by up to two); in fp32 the CPU torch silu takes another exp (SLEEF): a few fp32 ulps.
- bf16 products whose fp32 sums run in another order than cuBLAS / CPU BLAS (the projections): at most one
  bf16 ulp of the rounded product, since both sides round a sum that differs by fp32 summation error only
  (on CUDA against cuBLAS with its reduced-precision split-K reductions off; also against fp32 products).
- cos / sin: within an fp32 ulp of torch's (numpy's cos in the interpreter; libdevice's on the GPU, which is
  torch's own on CUDA); rows rotated by them: one bf16 ulp, plus 1e-6 absolutely (a value rotated by angles
  an fp32 ulp apart moves by ~1e-7 on unit-RMS rows, however small it is).
- top-k: the same selected set (the same multiset of values as torch.topk's), ties at the k-th value taken
  lowest columns first, columns ascending.
Legend: T tokens, K input features, N output features, C compressor width, H heads or rotary pairs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from moemesh.common.kernels.glue import INTERPRET_ON_CPU_ENV, forced_torch_glue  # noqa: E402
from moemesh.common.model.random_init import random_fp8_linear  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
REPO_ROOT = Path(__file__).resolve().parent.parent

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs the kernels under TRITON_INTERPRET=1 "
                                 "(test_interpreted_cases_in_a_child runs them)")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING, reason="needs a CUDA device, compiled kernels")

if INTERPRETING:  # the interpreter's bf16 dots, bf16 rounding and scalar loop bounds as the GPU has them
    from moemesh.bench.checks.attention import patch_interpreter_scalar_index
    from moemesh.bench.checks.quantized_kernels import patch_interpreter_bf16_dot, patch_interpreter_bf16_rounding

    patch_interpreter_bf16_dot()
    patch_interpreter_bf16_rounding()
    patch_interpreter_scalar_index()


def test_interpreted_cases_in_a_child():
    if INTERPRETING:
        pytest.skip("this process interprets: the cases run here")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreted",
                           str(Path(__file__).resolve())], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


# ------------------------------------------------------------------------------------------ helpers
def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at |values| (fp32 tensor of the same shape; the smallest normal's at 0)."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    _, exponent = torch.frexp(values.float().abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(values, dtype=torch.float32), exponent - bits)


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: float = 1.0,
                       extra: torch.Tensor | float = 0.0) -> None:
    """|got - want| <= ulps · ulp(want) (the larger of the two sides' ulps) + extra, elementwise."""
    got, want = got.float(), want.float()
    spacing = torch.maximum(ulp(want, dtype), ulp(got, dtype))
    excess = (got - want).abs() - (ulps * spacing + extra)
    assert torch.isfinite(got).all() and excess.max() <= 0, f"worst excess {excess.max().item():.3g}"


# ------------------------------------------------------------------------------------ shared expert
def _fp8_pair(num_out, num_in, generator, device="cpu"):
    return random_fp8_linear(num_out, num_in, generator=generator, device=device)


def _gate_up_cases():
    from moemesh.common.kernels.fp8_linear_config import Fp8LinearConfig

    return [(None, "heuristic"), (Fp8LinearConfig(block_n=32, block_t=16, split_k=3), "split3"),
            (Fp8LinearConfig(block_n=32, block_t=1, use_fma=True, split_k=2), "fma_t1_split2")]


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("limit", [0.75, None], ids=["clamped", "unclamped"])
def test_interpreted_gate_up_swiglu_equals_the_unfused_code(dtype, num_tokens, limit):
    from moemesh.common.kernels.fp8_linear import fp8_gate_up_swiglu, fp8_linear
    from moemesh.common.model.moe import _swiglu

    generator = torch.Generator().manual_seed(num_tokens)
    (w1, s1), (w3, s3) = _fp8_pair(200, 384, generator), _fp8_pair(200, 384, generator)  # ragged N
    x = torch.randn(num_tokens, 384, generator=generator).to(dtype)
    for config, name in _gate_up_cases():
        if config is not None and config.block_t == 1 and num_tokens > 1:
            continue
        reference = _swiglu(fp8_linear(x, w1, s1, config=config), fp8_linear(x, w3, s3, config=config), limit)
        fused = fp8_gate_up_swiglu(x, w1, s1, w3, s3, swiglu_limit=limit, config=config)
        assert fused.dtype == dtype and fused.shape == reference.shape, name
        if limit is not None:  # the clamps are exercised
            assert (fp8_linear(x, w1, s1).abs() > limit).any(), name
        if dtype == torch.bfloat16:
            assert torch.equal(fused, reference), name
        else:
            assert_within_ulps(fused, reference, dtype, ulps=4)


# (name, N, group, norm, rope pairs): the attention projections' glue as RowNorm epilogues, at small size
ROW_NORM_CASES = [("q_lat", 256, 256, "weighted", 0), ("q_heads", 256, 64, "unweighted", 8),
                  ("kv", 128, 128, "weighted", 8), ("indexer_q", 256, 64, "none", 8)]


def _row_norm_inputs(num_tokens, num_out, group, norm, rope_half, generator, device="cpu"):
    from moemesh.common.kernels.fp8_linear import RowNorm
    from moemesh.common.kernels.norm_rope import NormKind

    kind = {"weighted": NormKind.WEIGHTED, "unweighted": NormKind.UNWEIGHTED, "none": NormKind.NONE}[norm]
    weight = torch.rand(group, generator=generator, device=device) + 0.5 if kind is NormKind.WEIGHTED else None
    angles = torch.rand(num_tokens, rope_half, generator=generator, device=device) * 6.0
    rope = (angles.cos(), angles.sin()) if rope_half else (None, None)
    return RowNorm(group, kind, 1e-6, weight, *rope)


def _separate_row_norm(y, row_norm):
    """The second launch RowNorm replaces: norm_rope over the output viewed [T, N / G, G]."""
    from moemesh.common.kernels.norm_rope import norm_rope

    grouped = y.view(y.shape[0], -1, row_norm.group)
    return norm_rope(grouped, norm=row_norm.norm, eps=row_norm.eps, weight=row_norm.weight, cos=row_norm.cos,
                     sin=row_norm.sin).view_as(y)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("case", ROW_NORM_CASES, ids=[case[0] for case in ROW_NORM_CASES])
def test_interpreted_fp8_linear_row_norm_equals_a_second_launch(dtype, num_tokens, case):
    from moemesh.common.kernels.fp8_linear import fp8_linear
    from moemesh.common.kernels.fp8_linear_config import Fp8LinearConfig

    _, num_out, group, norm, rope_half = case
    generator = torch.Generator().manual_seed(num_tokens * 7 + num_out)
    weight, scale = _fp8_pair(num_out, 384, generator)
    x = torch.randn(num_tokens, 384, generator=generator).to(dtype)
    row_norm = _row_norm_inputs(num_tokens, num_out, group, norm, rope_half, generator)
    configs = [None, Fp8LinearConfig(block_n=32, block_t=16, split_k=3), Fp8LinearConfig(block_n=64, block_t=16)]
    for config in configs:
        fused = fp8_linear(x, weight, scale, config=config, row_norm=row_norm)
        separate = _separate_row_norm(fp8_linear(x, weight, scale, config=config), row_norm)
        assert torch.equal(fused, separate), config


@interpreted
@pytest.mark.parametrize("case", ROW_NORM_CASES, ids=[case[0] for case in ROW_NORM_CASES])
def test_interpreted_linear_norm_rope_is_one_launch_with_the_glue_values(monkeypatch, case):
    """The attention's projection + norm + RoPE (`normed_linear.linear_norm_rope`) with an FP8 linear on its
    kernel: one launch, and the values of the linear followed by the torch norm / RoPE (to one bf16 ulp)."""
    from moemesh.common.model.normed_linear import linear_norm_rope
    from moemesh.common.model.quantized import Fp8Linear, KernelBackend

    _, num_out, group, norm, rope_half = case
    generator = torch.Generator().manual_seed(num_out + rope_half)
    linear = Fp8Linear(*_fp8_pair(num_out, 384, generator), backend=KernelBackend.KERNEL)
    x = torch.randn(3, 384, generator=generator).to(torch.bfloat16)
    row_norm = _row_norm_inputs(3, num_out, group, norm, rope_half, generator)
    kwargs = {"group": group, "norm": norm != "none", "eps": row_norm.eps, "weight": row_norm.weight,
              "cos": row_norm.cos, "sin": row_norm.sin}
    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")
    launched, fused = _launched_kernels(lambda: linear_norm_rope(linear, x, **kwargs))
    assert launched == ["_fp8_linear_kernel"], launched
    with forced_torch_glue():
        unfused = linear_norm_rope(linear, x, **kwargs)
    assert fused.shape == unfused.shape == (3, num_out)
    assert_within_ulps(fused, unfused, torch.bfloat16)


def test_row_norm_rejects_groups_that_do_not_fit():
    from moemesh.common.kernels.fp8_linear import RowNorm, _row_norm_args
    from moemesh.common.kernels.norm_rope import NormKind

    with pytest.raises(ValueError, match="power of two"):
        _row_norm_args(RowNorm(96, NormKind.UNWEIGHTED), 1, 192, 32)
    with pytest.raises(ValueError, match="multiple of block_n"):
        _row_norm_args(RowNorm(32, NormKind.UNWEIGHTED), 1, 256, 64)
    with pytest.raises(ValueError, match="do not fit"):
        _row_norm_args(RowNorm(64, NormKind.NONE, cos=torch.zeros(2, 8), sin=torch.zeros(2, 8)), 1, 256, 64)
    with pytest.raises(ValueError, match="exactly when"):
        RowNorm(64, NormKind.WEIGHTED)


def _shared_expert(limit_on: bool, generator, device="cpu", dtype=torch.bfloat16, hidden=256, inter=384):
    from moemesh.common.model.moe import SharedExpert
    from moemesh.common.model.quantized import Fp8Linear, KernelBackend
    from moemesh.common.model.random_init import tiny_flash_like_config
    from moemesh.common.model.config import AttentionKind, NumericsConfig

    config = tiny_flash_like_config((AttentionKind.WINDOW,), hidden_size=hidden, moe_intermediate_size=inter)
    expert = SharedExpert(config, NumericsConfig(shared_expert_clamp=limit_on), dtype=dtype, device=device)
    backend = KernelBackend.KERNEL if device == "cpu" else KernelBackend.AUTO
    for name, (num_out, num_in) in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
        expert.set_submodule(name, Fp8Linear(*_fp8_pair(num_out, num_in, generator, device), backend=backend))
    return expert


@interpreted
@pytest.mark.parametrize("limit_on", [True, False], ids=["clamped", "unclamped"])
def test_interpreted_shared_expert_takes_two_launches_with_the_same_result(limit_on, monkeypatch):
    from moemesh.common.kernels import fp8_linear as fp8_module

    generator = torch.Generator().manual_seed(7)
    expert = _shared_expert(limit_on, generator)
    if limit_on:
        expert.limit = 0.75  # so that the tiny model's products reach it
    x = torch.randn(5, 256, generator=generator).bfloat16()
    launches = []
    original_launch = fp8_module._launch
    monkeypatch.setattr(fp8_module, "_launch", lambda *a, **k: launches.append(a[2] is not None) or
                        original_launch(*a, **k))
    fused = expert(x)
    assert launches == [True, False]  # gate-up + SwiGLU, then w2
    launches.clear()
    with forced_torch_glue():
        unfused = expert(x)
    assert launches == [False, False, False]
    assert torch.equal(fused, unfused)
    # prefill sizes keep the three linears
    launches.clear()
    expert(torch.randn(65, 256, generator=generator).bfloat16())
    assert launches == [False, False, False]


def test_shared_expert_on_plain_linears_is_unchanged():
    """Float `Linear` weights (the CPU model, bf16 checkpoints): the torch code, nothing fused."""
    from moemesh.common.model.config import AttentionKind, NumericsConfig
    from moemesh.common.model.moe import SharedExpert, _swiglu
    from moemesh.common.model.random_init import tiny_flash_like_config

    config = tiny_flash_like_config((AttentionKind.WINDOW,))
    expert = SharedExpert(config, NumericsConfig(), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    for param in expert.parameters():
        param.data = torch.randn(param.shape, generator=generator)
    x = torch.randn(3, config.hidden_size, generator=generator)
    assert expert._fused_gate_up(x) is None
    assert torch.equal(expert(x), expert.w2(_swiglu(expert.w1(x), expert.w3(x), expert.limit)))


# -------------------------------------------------------------------------------------- projections
def _projection_weights(generator, width, num_heads, in_features, dtype, device="cpu"):
    def weight(rows):
        return (torch.randn(rows, in_features, generator=generator, device=device) * in_features**-0.5).to(dtype)

    return weight(width), weight(width), weight(num_heads)


def _check_projections(x, kv_w, score_w, head_w, ape, positions, outputs, head_scale):
    """Against the torch code (on CUDA with cuBLAS's reduced-precision split-K reductions off, which torch allows by
    default) and against fp32 products rounded once: one ulp of the rounded product, plus the bound on how far two
    fp32 summation orders of K products can part, 2·K·2^-24·Σ|x·w| (the kernel's tiles and cuBLAS's sum in
    different orders; near-zero outputs are where that exceeds an ulp)."""
    dtype = x.dtype
    kv, score = outputs[:2]
    assert kv.dtype == dtype and score.dtype == torch.float32
    rows = positions % ape.shape[0]

    def order_bound(w):
        return 2 * x.shape[-1] * 2.0**-24 * F.linear(x.float().abs(), w.float().abs())

    matmul = torch.backends.cuda.matmul
    reduced = matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    try:
        for product in (F.linear, lambda a, w: F.linear(a.float(), w.float()).to(dtype)):
            ref_kv, ref_product = product(x, kv_w), product(x, score_w)
            assert_within_ulps(kv, ref_kv, dtype, extra=order_bound(kv_w))
            assert_within_ulps(score, ref_product + ape[rows], torch.float32,
                               extra=ulp(ref_product, dtype) + order_bound(score_w))
            if head_w is not None:
                assert outputs[2].dtype == torch.float32
                assert_within_ulps(outputs[2], product(x, head_w).float() * head_scale, dtype,
                                   extra=order_bound(head_w) * head_scale)
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = reduced


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_interpreted_projections_equal_the_torch_code(dtype, num_tokens):
    from moemesh.common.kernels.projections import ProjectionConfig, compressor_projections

    generator = torch.Generator().manual_seed(num_tokens)
    width, num_heads, in_features, ratio = 72, 24, 320, 4  # ragged tiles, K not a multiple of the K step
    kv_w, score_w, head_w = _projection_weights(generator, width, num_heads, in_features, dtype)
    ape = torch.randn(ratio, width, generator=generator)
    positions = torch.randint(0, 5000, (num_tokens,), generator=generator)
    x = torch.randn(num_tokens, in_features, generator=generator).to(dtype)
    for config in (None, ProjectionConfig(block_n=32, block_k=64, split_k=1),
                   ProjectionConfig(block_n=16, block_k=128, split_k=3)):
        with_heads = compressor_projections(x, kv_w, score_w, ape, positions, head_weight=head_w,
                                            head_scale=num_heads**-0.5, config=config)
        _check_projections(x, kv_w, score_w, head_w, ape, positions, with_heads, num_heads**-0.5)
        without = compressor_projections(x, kv_w, score_w, ape, positions, config=config)
        assert len(without) == 2 and torch.equal(without[0], with_heads[0]) and torch.equal(without[1], with_heads[1])


@interpreted
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_interpreted_second_compressor_shares_the_launch(num_tokens):
    """A CSA layer's compressor and the indexer's (another width, its head weights) in one launch: each output
    equals its own launch's bit for bit at the same split, and the torch code within an ulp at the default one."""
    from moemesh.common.kernels.projections import ProjectionConfig, compressor_projections

    generator = torch.Generator().manual_seed(11 + num_tokens)
    dtype, in_features, ratio, num_heads = torch.bfloat16, 320, 4, 24
    kv_w, score_w, _ = _projection_weights(generator, 72, num_heads, in_features, dtype)
    kv2_w, score2_w, head_w = _projection_weights(generator, 40, num_heads, in_features, dtype)
    ape, ape2 = torch.randn(ratio, 72, generator=generator), torch.randn(ratio, 40, generator=generator)
    positions = torch.randint(0, 5000, (num_tokens,), generator=generator)
    x = torch.randn(num_tokens, in_features, generator=generator).to(dtype)
    for config in (ProjectionConfig(block_n=32, block_k=64, split_k=1), ProjectionConfig(block_n=16, split_k=3)):
        both = compressor_projections(x, kv_w, score_w, ape, positions, second=(kv2_w, score2_w, ape2),
                                      head_weight=head_w, head_scale=num_heads**-0.5, config=config)
        first = compressor_projections(x, kv_w, score_w, ape, positions, config=config)
        second = compressor_projections(x, kv2_w, score2_w, ape2, positions, head_weight=head_w,
                                        head_scale=num_heads**-0.5, config=config)
        assert len(both) == 5
        for got, want in zip(both, first + second):
            assert torch.equal(got, want)
    both = compressor_projections(x, kv_w, score_w, ape, positions, second=(kv2_w, score2_w, ape2),
                                  head_weight=head_w, head_scale=num_heads**-0.5)
    _check_projections(x, kv_w, score_w, head_w, ape, positions, (*both[:2], both[4]), num_heads**-0.5)
    _check_projections(x, kv2_w, score2_w, head_w, ape2, positions, both[2:], num_heads**-0.5)
    with pytest.raises(ValueError, match="do not match"):
        compressor_projections(x, kv_w, score_w, ape, positions, second=(kv2_w, score2_w, ape2[:2]))


def test_projections_refuse_what_they_do_not_compute():
    from moemesh.common.kernels import projections

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert projections.supports(x, weight, weight)
    assert not projections.supports(x.float(), weight.float())  # fp32: the torch path
    assert not projections.supports(torch.zeros(65, 64, dtype=torch.bfloat16), weight)  # prefill
    assert not projections.supports(x, weight.t().contiguous().t())  # not contiguous
    assert not projections.supports(x, torch.zeros(8, 64, dtype=torch.float16))


@interpreted
def test_interpreted_compressor_and_indexer_dispatch_to_one_launch(monkeypatch):
    from moemesh.common.kernels import projections
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.indexer import Indexer
    from moemesh.common.model.random_init import tiny_flash_like_config

    config = tiny_flash_like_config((AttentionKind.CSA,), kernel_friendly=True)
    generator = torch.Generator().manual_seed(3)
    indexer = Indexer(config, dtype=torch.bfloat16)
    for param in indexer.parameters():
        param.data = (torch.randn(param.shape, generator=generator) * 0.1).to(param.dtype)
    x = torch.randn(3, config.hidden_size, generator=generator).bfloat16()
    positions = torch.tensor([5, 130, 4095])
    calls = []
    original = projections.compressor_projections
    monkeypatch.setattr(projections, "compressor_projections", lambda *a, **k: calls.append(1) or original(*a, **k))
    with forced_torch_glue():
        ref_kv, ref_score, ref_heads = indexer.project_inputs(x, positions)
        ref_project = indexer.compressor.project(x, positions)
    assert not calls
    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")
    kv, score, heads = indexer.project_inputs(x, positions)
    project = indexer.compressor.project(x, positions)
    with_layer = indexer.project_inputs(x, positions, indexer.compressor)  # a stand-in for the layer's compressor
    assert len(calls) == 3 and len(with_layer) == 5
    assert_within_ulps(with_layer[0], ref_project[0], torch.bfloat16)
    assert_within_ulps(with_layer[2], ref_kv, torch.bfloat16)
    assert_within_ulps(kv, ref_kv, torch.bfloat16)
    assert_within_ulps(project[0], ref_project[0], torch.bfloat16)
    product = F.linear(x, indexer.compressor.wgate.weight)
    for got in (score, project[1]):
        assert_within_ulps(got, ref_score, torch.float32, extra=ulp(product, torch.bfloat16))
    assert_within_ulps(heads, ref_heads, torch.bfloat16)


# ------------------------------------------------------------------------------------------- top-k
def _check_top_k(scores: torch.Tensor, picked: torch.Tensor, k: int) -> None:
    assert picked.shape == (scores.shape[0], k) and picked.dtype == torch.int64
    for row, cols in zip(scores, picked):  # [N], [k]
        assert torch.equal(cols, cols.sort().values) and cols.unique().numel() == k, "ascending, distinct"
        values = row[cols]
        largest = row.topk(k).values  # descending
        assert torch.equal(values.sort(descending=True).values, largest), "the k largest"
        kth = largest[-1]
        need = k - int((row > kth).sum())
        equal_cols = (row == kth).nonzero().flatten()
        assert torch.equal(cols[values == kth], equal_cols[:need]), "ties: lowest columns first"


def _score_rows(generator, num_tokens, num_cols, device="cpu"):
    scores = torch.randn(num_tokens, num_cols, generator=generator, device=device)
    scores[:, 3::7] = float("-inf")  # rows a token cannot see
    scores[0, 10:60] = 0.0  # ReLU zeros: ties at the k-th value
    scores[0, 60:70] = -0.0
    return scores


@interpreted
@pytest.mark.parametrize("num_tokens,num_cols,k", [(1, 300, 17), (3, 1024, 512), (2, 5000, 512), (4, 129, 128),
                                                   (1, 64, 64)])
def test_interpreted_top_k_columns_pick_the_k_largest(num_tokens, num_cols, k):
    from moemesh.common.kernels.indexer_topk import top_k_columns

    generator = torch.Generator().manual_seed(num_cols)
    scores = _score_rows(generator, num_tokens, num_cols)
    _check_top_k(scores, top_k_columns(scores, k), k)
    ties = torch.randint(-3, 3, (num_tokens, num_cols), generator=generator).float()  # many equal values
    _check_top_k(ties, top_k_columns(ties, k), k)


@interpreted
def test_interpreted_top_k_columns_over_several_blocks(monkeypatch):
    from moemesh.common.kernels import indexer_topk

    monkeypatch.setattr(indexer_topk, "TOPK_MAX_BLOCK", 128)  # rows of 1000 read in 8 blocks per pass
    generator = torch.Generator().manual_seed(4)
    scores = _score_rows(generator, 3, 1000)
    scores[1, 100:300] = 1.5
    for k in (100, 400):
        _check_top_k(scores, indexer_topk.top_k_columns(scores, k), k)


def test_top_k_columns_keeps_torch_topk_for_many_tokens():
    from moemesh.common.kernels.indexer_topk import TOPK_KERNEL_MAX_TOKENS, top_k_columns

    scores = torch.randn(TOPK_KERNEL_MAX_TOKENS + 1, 40)
    picked = top_k_columns(scores, 8)
    assert torch.equal(scores.gather(1, picked).sort(-1).values, scores.topk(8).values.sort(-1).values)
    with pytest.raises(ValueError):
        top_k_columns(scores, 41)


# -------------------------------------------------------------------------------------------- RoPE
def _rotary_table(device="cpu"):
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import flash_config
    from moemesh.common.model.rope import RotaryTable

    table = RotaryTable.for_config(flash_config((AttentionKind.CSA,)), compressed=True)  # V4-Flash: 32 pairs, YaRN
    return RotaryTable(table.name, table.rope_dim, table.inv_freq.to(device))


def _torch_cos_sin(table, positions):
    angles = positions[:, None].float() * table.inv_freq
    return angles.cos(), angles.sin()


@interpreted
def test_interpreted_cos_sin_equal_torch():
    from moemesh.common.kernels.norm_rope import rope_cos_sin

    table = _rotary_table()
    positions = torch.cat([torch.arange(0, 40), torch.randint(0, 1 << 20, (37,), generator=torch.Generator()
                                                              .manual_seed(0))])  # up to 1M: large angles
    cos, sin = rope_cos_sin(positions, table.inv_freq)
    ref_cos, ref_sin = _torch_cos_sin(table, positions)
    assert cos.shape == ref_cos.shape and cos.dtype == torch.float32
    assert (cos - ref_cos).abs().max() <= 2**-23 and (sin - ref_sin).abs().max() <= 2**-23


def _pooled_rows(generator, num_rows, row_dim, device="cpu"):
    return torch.randn(num_rows, row_dim, generator=generator, device=device) * 3


def _torch_window_rows(pooled, weight, eps, table, positions, tokens, ratio, dtype):
    from moemesh.common.model.rope import rms_norm_rope

    with forced_torch_glue():
        row_positions = torch.div(positions[tokens], ratio, rounding_mode="floor") * ratio
        cos, sin = _torch_cos_sin(table, row_positions)
        return rms_norm_rope(pooled.to(dtype), cos, sin, eps, weight=weight)


@interpreted
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_interpreted_window_rows_equal_the_torch_row_path(ratio, dtype):
    from moemesh.common.kernels.norm_rope import window_rows_norm_rope

    table = _rotary_table()
    generator = torch.Generator().manual_seed(ratio)
    positions = torch.randint(0, 70000, (9,), generator=generator)  # [T]
    tokens = torch.tensor([0, 3, 4, 8, 8])  # [Nc]
    pooled = _pooled_rows(generator, 5, 128)
    weight = 1 + 0.1 * torch.randn(128, generator=generator)
    rows = window_rows_norm_rope(pooled, weight=weight, eps=1e-6, inv_freq=table.inv_freq, positions=positions,
                                 tokens=tokens, ratio=ratio, out_dtype=dtype)
    reference = _torch_window_rows(pooled, weight, 1e-6, table, positions, tokens, ratio, dtype)
    assert rows.dtype == dtype
    # unit-RMS rows: cos / sin an fp32 ulp apart move a rotated value by ~1e-7 absolutely
    assert_within_ulps(rows, reference, dtype, ulps=1 if dtype == torch.bfloat16 else 0, extra=1e-6)


@interpreted
def test_interpreted_rope_dispatch_sites(monkeypatch):
    """`RotaryTable.cos_sin` and `window_rows_norm_rope` take the kernels under the glue rule, torch otherwise."""
    from moemesh.common.kernels import norm_rope
    from moemesh.common.model.rope import window_rows_norm_rope

    table = _rotary_table()
    generator = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 9000, (4,), generator=generator)
    tokens = torch.tensor([1, 3])
    pooled = _pooled_rows(generator, 2, 64)
    weight = torch.ones(64)
    calls = []
    for name in ("rope_cos_sin", "window_rows_norm_rope"):
        original = getattr(norm_rope, name)
        monkeypatch.setattr(norm_rope, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    reference = window_rows_norm_rope(pooled, weight, 1e-6, table, positions, tokens, 4, torch.bfloat16)
    ref_cos, _ = table.cos_sin(positions)
    assert not calls
    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")
    rows = window_rows_norm_rope(pooled, weight, 1e-6, table, positions, tokens, 4, torch.bfloat16)
    cos, _ = table.cos_sin(positions)
    assert calls == ["window_rows_norm_rope", "rope_cos_sin"]
    assert_within_ulps(rows, reference, torch.bfloat16, extra=1e-6)
    assert (cos - ref_cos).abs().max() <= 2**-23


# -------------------------------------------------------------------------- attention layers, end to end
@interpreted
def test_interpreted_attention_layers_with_every_kernel_match_the_torch_layers(monkeypatch):
    """bf16 window / CSA / HCA layers: the batched path with the glue kernels on (projections, window rows,
    cos/sin, top-k) against the per-sequence torch path with the torch glue, prefill then decode and verify."""
    from moemesh.bench.checks.attention import BF16_TOLERANCE, random_layers
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import tiny_flash_like_config
    from moemesh.common.model.state import SequenceState

    from moemesh.common.kernels import indexer_topk, norm_rope, projections

    calls = {}
    for module, name in ((projections, "compressor_projections"), (norm_rope, "window_rows_norm_rope"),
                         (norm_rope, "rope_cos_sin"), (indexer_topk, "_indexer_scores_topk_kernel")):
        original = getattr(module, name)
        if name == "_indexer_scores_topk_kernel":  # launched as kernel[grid](...)
            counted = _CountedLaunch(original, name, calls)
        else:
            counted = (lambda *a, _f=original, _n=name, **k: calls.update({_n: calls.get(_n, 0) + 1}) or _f(*a, **k))
        monkeypatch.setattr(module, name, counted)
    config = tiny_flash_like_config((AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA))
    dtype = torch.bfloat16
    layers = random_layers(config, dtype, "cpu", seed=1)
    reference_states = [SequenceState(config, dtype=dtype, device="cpu") for _ in range(2)]
    kernel_states = [SequenceState(config, dtype=dtype, device="cpu") for _ in range(2)]
    steps = [(37, 70)] + [(1, 1)] * 6 + [(3, 2)] + [(1, 1)] * 3
    generator = torch.Generator().manual_seed(3)
    worst = 0.0
    with torch.inference_mode():
        for lengths in steps:
            x = torch.randn(sum(lengths), config.hidden_size, generator=generator).to(dtype)
            with forced_torch_glue():
                batch = ForwardBatch([SequenceChunk(s, n) for s, n in zip(reference_states, lengths)], "cpu",
                                     attention_backend=AttentionBackend.TORCH)
                expected = [layer(x, batch) for layer in layers]
                batch.finish()
            with monkeypatch.context() as patch:
                patch.setenv(INTERPRET_ON_CPU_ENV, "1")
                batch = ForwardBatch([SequenceChunk(s, n) for s, n in zip(kernel_states, lengths)], "cpu",
                                     attention_backend=AttentionBackend.TRITON)
                assert batch.attention_tables is not None
                got = [layer(x, batch) for layer in layers]
                batch.finish()
            for out, ref in zip(got, expected):
                worst = max(worst, float((out.float() - ref.float()).norm() / ref.float().norm()))
    assert worst <= BF16_TOLERANCE, worst
    assert set(calls) == {"compressor_projections", "window_rows_norm_rope", "rope_cos_sin",
                          "_indexer_scores_topk_kernel"}, calls


# -------------------------------------------------------------------------------------- mHC sites
def _launched_kernels(run):
    """Names of the Triton kernels `run()` launches under the interpreter, in order."""
    from triton.runtime import interpreter

    launched, original = [], interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = counted
    try:
        result = run()
    finally:
        interpreter.GridExecutor.__call__ = original
    return launched, result


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_ffn_post_does_the_next_sites_mix(monkeypatch, dtype):
    """ffn_post of layer 0 computes layer 1's attention-site mix in its launch: that hc_pre is one launch
    (the finish, with attn_norm), its results match the torch sites; a different h gets its own mix."""
    from moemesh.common.model.config import AttentionKind, NumericsConfig
    from moemesh.common.model.random_init import random_attention_side, tiny_flash_like_config

    config = tiny_flash_like_config((AttentionKind.WINDOW, AttentionKind.WINDOW))
    numerics = NumericsConfig(dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    side = random_attention_side(config, numerics, "cpu", seed=4)
    generator = torch.Generator().manual_seed(5)
    h = torch.randn(3, config.hc_mult, config.hidden_size, generator=generator).to(dtype)  # [T, N, D]
    y, shared = (torch.randn(3, config.hidden_size, generator=generator).to(dtype) for _ in range(2))

    def sites():
        _, post, comb = side.ffn_pre(0, h)
        h1 = side.ffn_post(0, y, h, post, comb, shared=shared)
        return h1, side._hc_pre(1, "attn", h1)

    with forced_torch_glue():
        ref_h1, ref_site = sites()
    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")
    launched, (h1, site) = _launched_kernels(sites)
    assert launched == ["_mix_gemv_kernel", "_hc_finish_kernel", "_hc_post_kernel", "_hc_finish_kernel"], launched
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip((h1, *site), (ref_h1, *ref_site)):
        assert float((got.float() - want.float()).norm() / want.float().norm()) <= tolerance
    launched, _ = _launched_kernels(lambda: side._hc_pre(1, "attn", h1.clone()))
    assert launched == ["_mix_gemv_kernel", "_hc_finish_kernel"], launched


# ---------------------------------------------------------------------------- sm_90 compiles (no GPU)
def _hopper_variants():
    """(name, kernel, signature, constexprs, options) of every new kernel variant at V4-Flash's decode shapes."""
    from moemesh.common.kernels import indexer_topk, norm_rope, projections
    from moemesh.common.kernels.fp8_linear import _fp8_linear_kernel

    variants = []
    fp8_sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "w_up_ptr": "*u8", "s_up_ptr": "*u8",
               "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32", "num_tokens": "i32",
               "out_features": "i32", "in_features": "i32", "swiglu_limit": "fp32", "stride_xt": "i32",
               "stride_wn": "i32", "stride_sn": "i32", "stride_ot": "i32", "stride_ps": "i32", "stride_pt": "i32"}
    for quad in (True, False):  # the GPU's default (inline-PTX decode) and the portable decode
        variants.append((f"gate_up_swiglu_quad{int(quad)}", _fp8_linear_kernel, fp8_sig,
                         {"SPLIT_K": 8, "K_STEPS_PER_SPLIT": 4, "USE_FMA": False, "ASM_DECODE": quad, "ASM_QUAD": quad,
                          "GATE_UP": True, "HAS_LIMIT": True, "BLOCK_N": 64, "BLOCK_T": 16, "BLOCK_K": 128,
                          "QUANT_BLOCK": 128, "NORM_GROUP": 0, "NORM": 0, "ROPE": False, "ROPE_BLOCK": 1},
                         {"num_warps": 4 if quad else 8, "num_stages": 4}))
    row_norm_sig = {**fp8_sig, "norm_weight_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "rope_half": "i32",
                    "norm_eps": "fp32"}
    for name, group, norm, rope in (("q_lat", 1024, 2, False), ("q_heads", 512, 1, True), ("kv", 512, 2, True),
                                    ("indexer_q", 128, 0, True)):
        variants.append((f"fp8_linear_row_norm_{name}", _fp8_linear_kernel, row_norm_sig,
                         {"SPLIT_K": 8, "K_STEPS_PER_SPLIT": 4, "USE_FMA": False, "ASM_DECODE": True, "ASM_QUAD": True,
                          "GATE_UP": False, "HAS_LIMIT": False, "BLOCK_N": 64, "BLOCK_T": 16, "BLOCK_K": 128,
                          "QUANT_BLOCK": 128, "NORM_GROUP": group, "NORM": norm, "ROPE": rope, "ROPE_BLOCK": 32},
                         {"num_warps": 4, "num_stages": 4}))
    projection_sig = {"x_ptr": "*bf16", "kv_w_ptr": "*bf16", "score_w_ptr": "*bf16", "kv2_w_ptr": "*bf16",
                      "score2_w_ptr": "*bf16", "head_w_ptr": "*bf16", "kv_ptr": "*bf16", "score_ptr": "*fp32",
                      "kv2_ptr": "*bf16", "score2_ptr": "*fp32", "head_ptr": "*fp32", "ape_ptr": "*fp32",
                      "ape2_ptr": "*fp32", "positions_ptr": "*i64", "partial_ptr": "*fp32", "counter_ptr": "*i32",
                      "num_tokens": "i32", "in_features": "i32", "width": "i32", "width2": "i32", "num_heads": "i32",
                      "head_scale": "fp32", "stride_xt": "i32", "stride_ps": "i32", "stride_pt": "i32"}
    # the CSA layer's compressor with the indexer's (one launch), an HCA layer's alone
    for name, ratio, width_tiles, width2_tiles, split in (("csa", 4, 16, 4, 8), ("hca", 128, 8, 0, 16)):
        variants.append((f"projections_{name}", projections._projections_kernel, projection_sig,
                         {"RATIO": ratio, "WIDTH_TILES": width_tiles, "WIDTH2_TILES": width2_tiles, "SPLIT_K": split,
                          "K_STEPS_PER_SPLIT": 32 // split, "BLOCK_N": 64, "BLOCK_T": 16, "BLOCK_K": 128},
                         {"num_warps": 4, "num_stages": 4}))
    topk_sig = {"scores_ptr": "*fp32", "out_ptr": "*i64", "num_cols": "i32", "k": "i32", "stride_row": "i32"}
    for one_block, block, warps in ((True, 1024, 4), (True, 4096, 8), (False, 4096, 8)):
        variants.append((f"topk_block{block}_one{int(one_block)}", indexer_topk._topk_kernel, topk_sig,
                         {"ONE_BLOCK": one_block, "BLOCK": block, "RADIX_BITS": 8, "NUM_DIGITS": 4},
                         {"num_warps": warps}))
    rows_sig = {"x_ptr": "*fp32", "out_ptr": "*bf16", "weight_ptr": "*fp32", "inv_freq_ptr": "*fp32",
                "positions_ptr": "*i64", "tokens_ptr": "*i64", "num_channels": "i32", "rope_half": "i32", "eps": "fp32"}
    variants.append(("window_rows", norm_rope._window_rows_norm_rope_kernel, rows_sig,
                     {"RATIO": 4, "BLOCK_C": 512, "BLOCK_H": 32}, {"num_warps": 2}))
    cos_sin_sig = {"positions_ptr": "*i64", "inv_freq_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                   "num_positions": "i32", "rope_half": "i32"}
    variants.append(("cos_sin", norm_rope._cos_sin_kernel, cos_sin_sig, {"BLOCK_R": 16, "BLOCK_H": 32},
                     {"num_warps": 1}))
    return variants


def _ptxas_missing() -> bool:
    from moemesh.bench.kernel_sass import _tool

    return not os.path.exists(_tool("ptxas"))


@pytest.mark.skipif(INTERPRETING, reason="compiles: the interpreter replaces the kernels")
@pytest.mark.parametrize("variant", _hopper_variants(), ids=lambda variant: variant[0])
def test_kernel_compiles_for_sm90(variant):
    """The whole Triton + ptxas pipeline for sm_90 on this machine: what the interpreter accepts compiles; no
    spills but libdevice's sin / cos range reduction buffer."""
    if _ptxas_missing():
        pytest.skip("triton without its bundled ptxas")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moemesh.bench.kernel_sass import summarise

    name, kernel, signature, constexprs, options = variant
    source = ASTSource(kernel, {**signature, **{key: "constexpr" for key in constexprs}}, constexprs)
    summary = summarise(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options))
    allowed_stack = 32 if name in ("window_rows", "cos_sin") else 0
    assert summary["stack_bytes"] <= allowed_stack, summary
    if name.startswith("gate_up") or name.startswith("projections"):
        assert summary["opcodes"].get("HGMMA", 0) > 0, "no Hopper wgmma in the main loop"


class _CountedLaunch:
    """A Triton kernel stand-in counting `kernel[grid](...)` launches under `name` in `calls`."""

    def __init__(self, kernel, name: str, calls: dict) -> None:
        self.kernel, self.name, self.calls = kernel, name, calls

    def __getitem__(self, grid):
        self.calls[self.name] = self.calls.get(self.name, 0) + 1
        return self.kernel[grid]


# ------------------------------------------------------------------------------------ CUDA, V4-Flash
def _graph_replay(fn):
    """fn() captured in a CUDA graph after a warm-up; returns (eager output, replayed output)."""
    eager = fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    graph.replay()
    torch.cuda.synchronize()
    return eager, captured


def _fraction_equal(a, b) -> float:
    return float((a == b).float().mean())


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_cuda_shared_expert_fused_at_flash_size(num_tokens):
    """V4-Flash's shared expert (4096 -> 2048 -> 4096, limit 10): the fused gate-up equals the unfused linears
    + torch SwiGLU (the gate and up products are fp8_linear's own tiles; silu's exp is libdevice's, as torch's)."""
    from moemesh.common.kernels.fp8_linear import fp8_gate_up_swiglu, fp8_linear
    from moemesh.common.model.moe import _swiglu

    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    (w1, s1), (w3, s3) = _fp8_pair(2048, 4096, generator, "cuda"), _fp8_pair(2048, 4096, generator, "cuda")
    x = (torch.randn(num_tokens, 4096, generator=generator, device="cuda") * 4).bfloat16()  # products past 10
    reference = _swiglu(fp8_linear(x, w1, s1), fp8_linear(x, w3, s3), 10.0)
    eager, replayed = _graph_replay(lambda: fp8_gate_up_swiglu(x, w1, s1, w3, s3, swiglu_limit=10.0))
    assert (fp8_linear(x, w1, s1) > 10).any()
    assert torch.equal(eager, replayed)
    assert _fraction_equal(eager, reference) >= 0.999
    assert_within_ulps(eager, reference, torch.bfloat16, ulps=2)  # a silu one ulp off moves the product <= 2


# V4-Flash's projections with their glue: (name, N, K, group, norm, rope pairs)
FLASH_ROW_NORMS = [("wq_a", 1024, 4096, 1024, "weighted", 0), ("wq_b", 32768, 1024, 512, "unweighted", 32),
                   ("wkv", 512, 4096, 512, "weighted", 32), ("indexer_wq_b", 8192, 1024, 128, "none", 32)]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
@pytest.mark.parametrize("case", FLASH_ROW_NORMS, ids=[case[0] for case in FLASH_ROW_NORMS])
def test_cuda_row_norm_at_flash_size(case, num_tokens):
    """The norm / RoPE in the FP8 linear's launch against the same launch without it followed by the norm_rope
    kernel: equal but for the fp32 sum of squares' order (one bf16 ulp), and the same in a graph replay."""
    from moemesh.common.kernels.fp8_linear import fp8_linear

    _, num_out, num_in, group, norm, rope_half = case
    generator = torch.Generator(device="cuda").manual_seed(num_tokens + num_out)
    weight, scale = _fp8_pair(num_out, num_in, generator, "cuda")
    x = torch.randn(num_tokens, num_in, generator=generator, device="cuda").bfloat16()
    row_norm = _row_norm_inputs(num_tokens, num_out, group, norm, rope_half, generator, "cuda")
    eager, replayed = _graph_replay(lambda: fp8_linear(x, weight, scale, row_norm=row_norm))
    separate = _separate_row_norm(fp8_linear(x, weight, scale), row_norm)
    assert torch.equal(eager, replayed)
    assert _fraction_equal(eager, separate) >= 0.999
    assert_within_ulps(eager, separate, torch.bfloat16)


@cuda
@pytest.mark.cuda
def test_cuda_shared_expert_module_two_launches():
    generator = torch.Generator(device="cuda").manual_seed(2)
    expert = _shared_expert(True, generator, device="cuda", hidden=4096, inter=2048)
    x = torch.randn(4, 4096, generator=generator, device="cuda").bfloat16()
    fused = expert(x)
    with forced_torch_glue():
        unfused = expert(x)
    assert _fraction_equal(fused, unfused) >= 0.999
    assert_within_ulps(fused, unfused, torch.bfloat16, ulps=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        expert(x)
        torch.cuda.synchronize()
    kernels = [event for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, [event.name for event in kernels]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
@pytest.mark.parametrize("module", ["csa", "indexer", "hca"])
def test_cuda_projections_at_flash_size(module, num_tokens):
    from moemesh.common.kernels.projections import compressor_projections

    width, num_heads, ratio = {"csa": (1024, 0, 4), "indexer": (256, 64, 4), "hca": (512, 0, 128)}[module]
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    kv_w, score_w, head_w = _projection_weights(generator, width, max(num_heads, 1), 4096, torch.bfloat16, "cuda")
    head_w = head_w if num_heads else None
    ape = torch.randn(ratio, width, generator=generator, device="cuda")
    positions = torch.randint(0, 1 << 20, (num_tokens,), generator=generator, device="cuda")
    x = torch.randn(num_tokens, 4096, generator=generator, device="cuda").bfloat16()
    eager, replayed = _graph_replay(lambda: compressor_projections(x, kv_w, score_w, ape, positions, head_weight=head_w,
                                                                  head_scale=64**-0.5))
    for a, b in zip(eager, replayed):
        assert torch.equal(a, b)
    _check_projections(x, kv_w, score_w, head_w, ape, positions, eager, 64**-0.5)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
@pytest.mark.parametrize("num_cols", [1024, 2048, 4096, 8192, 32768])
def test_cuda_top_k_at_flash_size(num_tokens, num_cols):
    from moemesh.common.kernels.indexer_topk import top_k_columns

    generator = torch.Generator(device="cuda").manual_seed(num_cols)
    scores = _score_rows(generator, num_tokens, num_cols, "cuda")
    eager, replayed = _graph_replay(lambda: top_k_columns(scores, 512))
    assert torch.equal(eager, replayed)
    _check_top_k(scores.cpu(), eager.cpu(), 512)


@cuda
@pytest.mark.cuda
def test_cuda_cos_sin_and_window_rows_at_flash_size():
    from moemesh.common.kernels.norm_rope import rope_cos_sin, window_rows_norm_rope

    table = _rotary_table("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    positions = torch.randint(0, 1 << 20, (64,), generator=generator, device="cuda")
    (cos, sin), (cos_g, sin_g) = _graph_replay(lambda: rope_cos_sin(positions, table.inv_freq))
    ref_cos, ref_sin = _torch_cos_sin(table, positions)
    assert torch.equal(cos, cos_g) and torch.equal(sin, sin_g)
    assert (cos - ref_cos).abs().max() <= 2**-23 and (sin - ref_sin).abs().max() <= 2**-23
    tokens = torch.arange(64, device="cuda")
    for ratio, row_dim in ((4, 512), (4, 128), (128, 512)):
        pooled = _pooled_rows(generator, 64, row_dim, "cuda")
        weight = 1 + 0.1 * torch.randn(row_dim, generator=generator, device="cuda")
        rows, rows_g = _graph_replay(lambda: window_rows_norm_rope(
            pooled, weight=weight, eps=1e-6, inv_freq=table.inv_freq, positions=positions, tokens=tokens, ratio=ratio,
            out_dtype=torch.bfloat16))
        assert torch.equal(rows, rows_g)
        reference = _torch_window_rows(pooled, weight, 1e-6, table, positions, tokens, ratio, torch.bfloat16)
        assert_within_ulps(rows, reference, torch.bfloat16, extra=1e-6)


@interpreted
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_interpreted_grouped_fp8_linear_reads_and_writes_rows_in_place(num_tokens):
    """wo_a (`Fp8GroupedLinear`) on the grouped kernel through row ids equals the same launch over the transposed
    input, transposed back (the copies it saves), bit for bit, and the dequantised torch path within bf16."""
    from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat, grouped_down
    from moemesh.common.model.quantized import Fp8GroupedLinear, KernelBackend
    from moemesh.common.model.random_init import random_fp8_linear

    groups, out_per_group, in_features = 4, 128, 256
    weight, scale = random_fp8_linear(groups * out_per_group, in_features, generator=torch.Generator().manual_seed(0))
    x = torch.randn(num_tokens, groups, in_features, generator=torch.Generator().manual_seed(num_tokens)).bfloat16()
    got = Fp8GroupedLinear(weight, scale, groups, backend=KernelBackend.KERNEL)(x)  # [T, G·O]
    w, s = weight.view(groups, out_per_group, -1), scale.view(groups, out_per_group // 128, -1)
    stacked = ExpertWeights(w, s, w, s, w, s, WeightFormat.FP8_E4M3)
    offsets = torch.arange(0, groups + 1, dtype=torch.int32) * num_tokens
    transposed = grouped_down(x.transpose(0, 1).reshape(groups * num_tokens, -1), offsets, stacked)  # [G·T, O]
    assert torch.equal(got, transposed.view(groups, num_tokens, -1).transpose(0, 1).reshape(num_tokens, -1))
    want = Fp8GroupedLinear(weight, scale, groups, backend=KernelBackend.TORCH)(x.float())
    assert float((got.float() - want).norm() / want.norm()) < 1e-2
