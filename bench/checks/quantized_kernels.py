"""Kernel-vs-reference comparisons on fresh random inputs, shared by the tests and the benchmark.

`python -m moemesh.bench.checks.quantized_kernels --suite interpret` runs the small cases (meant for
`TRITON_INTERPRET=1` on CPU) and prints one JSON object per case; `--suite cuda` the real sizes.

Each check draws new random weights over all valid codes (every e2m1 nibble, e4m3 values from a
wide normal), random scale bytes, poisons the output buffer with NaN through the kernel's own
allocation (torch.empty) and compares `‖out − ref‖ / ‖ref‖` against a bound chosen from the dtypes:
the products are exact (dequantised weights and bf16 activations both fit bf16/fp32), so only
accumulation order (~1e-6) and, where the output or SwiGLU intermediate is bf16, one bf16
rounding (~3e-3) separate kernel and reference. tf32 dots (fp32 activations on GPU) get 2e-3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from moemesh.common.kernels import reference

TIGHT_TOLERANCE = 1e-4
BF16_TOLERANCE = 1e-2  # one bf16 rounding; the interpreter truncates instead of rounding (2x)
TF32_TOLERANCE = 2e-3


@dataclass(frozen=True)
class CheckResult:
    name: str
    relative_error: float
    tolerance: float
    all_finite: bool

    @property
    def passed(self) -> bool:
        return self.all_finite and self.relative_error <= self.tolerance


def patch_interpreter_bf16_dot() -> None:
    """Triton 3.6's interpreter multiplies bf16 *bit patterns* (stored as uint16) in tl.dot.

    Widen bf16 operands to fp32 first, as the hardware does; the interpreter's own casts and
    loads are left alone. A no-op outside `TRITON_INTERPRET=1`.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_moemesh_bf16_dot", False):
        return
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            data = (handle.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    builder._moemesh_bf16_dot = True


def patch_interpreter_bf16_rounding() -> None:
    """Triton 3.6's interpreter casts fp32 -> bf16 by *truncating* the mantissa; compiled kernels
    round to nearest even (`cvt.rn.bf16.f32`). Truncation doubles the rounding error of every bf16
    store, so an interpreted kernel looks ~2x less accurate than it is on the GPU (measured on the
    FP8 linear: 0.0033 vs 0.0017 relative to fp32, `bench/kernels_drift.py`). Round to nearest
    even instead, as the hardware does. A no-op outside `TRITON_INTERPRET=1`."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_moemesh_bf16_rounding", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round half to even on the dropped 16 bits
            nan = np.isnan(src.data)
            out = np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)  # keep NaN a (quiet) NaN
            return interpreter.TensorHandle(out, tl.bfloat16)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder._moemesh_bf16_rounding = True


def random_fp8_weight(shape: tuple[int, ...], generator: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight [..., N, K] from a wide normal (clamped to ±448) and ue8m0 bytes per 128x128."""
    *lead, num_rows, num_cols = shape
    values = torch.randn(shape, generator=generator, device=device) * 64
    weight = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_shape = (*lead, -(-num_rows // 128), -(-num_cols // 128))
    scale = torch.randint(116, 124, scale_shape, generator=generator, dtype=torch.uint8, device=device)
    return weight, scale


def random_fp4_weight(shape: tuple[int, ...], generator: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 bytes [..., N, K/2] over all 256 byte values and ue8m0 bytes [..., N, K/32]."""
    *lead, num_rows, num_cols = shape
    packed = torch.randint(0, 256, (*lead, num_rows, num_cols // 2), generator=generator, dtype=torch.uint8,
                           device=device)
    scale = torch.randint(118, 126, (*lead, num_rows, num_cols // 32), generator=generator, dtype=torch.uint8,
                          device=device)
    return packed, scale


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    out64, ref64 = out.to(torch.float64), ref.to(torch.float64)
    finite = bool(torch.isfinite(out64).all())
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)), finite


def _tolerance(x_dtype: torch.dtype, low_precision_output: bool, device: str) -> float:
    if low_precision_output:
        return BF16_TOLERANCE
    if x_dtype == torch.float32 and device == "cuda":
        return TF32_TOLERANCE
    return TIGHT_TOLERANCE


def check_fp8_linear(
    num_tokens: int, out_features: int, in_features: int, *, x_dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype = torch.float32, config=None, device: str = "cpu", seed: int = 0,
) -> CheckResult:
    from moemesh.common.kernels.fp8_linear import fp8_linear

    generator = torch.Generator(device=device).manual_seed(seed)
    weight, scale = random_fp8_weight((out_features, in_features), generator, device)
    x = torch.randn(num_tokens, in_features, generator=generator, device=device).to(x_dtype)
    out = fp8_linear(x, weight, scale, out_dtype=out_dtype, config=config)
    ref = reference.fp8_linear_reference(x, weight, scale)
    error, finite = _relative_error(out.cpu(), ref.cpu())
    name = f"fp8_linear T={num_tokens} N={out_features} K={in_features} x={x_dtype} out={out_dtype} {config}"
    return CheckResult(name, error, _tolerance(x_dtype, out_dtype != torch.float32, device), finite)


def random_expert_layout(num_rows: int, num_experts: int, generator: torch.Generator, *, num_empty: int = 0) -> torch.Tensor:
    """expert_offsets [E+1] int32 for `num_rows` rows spread at random, some experts left empty."""
    counts = torch.zeros(num_experts, dtype=torch.int64)
    live = torch.randperm(num_experts, generator=generator)[: max(1, num_experts - num_empty)]
    picks = live[torch.randint(0, len(live), (num_rows,), generator=generator)]
    counts.index_add_(0, picks, torch.ones(num_rows, dtype=torch.int64))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return offsets


def check_grouped_experts(
    num_rows: int, num_experts: int, hidden_size: int, intermediate_size: int, *,
    weight_format: int = 0, swiglu_limit: float | None = 10.0, with_row_weights: bool = True,
    x_dtype: torch.dtype = torch.bfloat16, num_empty: int = 0, gate_up_config=None, down_config=None,
    device: str = "cpu", seed: int = 0,
) -> CheckResult:
    """Both launches (gate-up + SwiGLU, then down) against `grouped_experts_reference`."""
    from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat, grouped_down, grouped_gate_up

    fmt = WeightFormat(weight_format)
    generator = torch.Generator(device=device).manual_seed(seed)
    make = random_fp4_weight if fmt == WeightFormat.FP4_E2M1 else random_fp8_weight
    w1, s1 = make((num_experts, intermediate_size, hidden_size), generator, device)
    w3, s3 = make((num_experts, intermediate_size, hidden_size), generator, device)
    w2, s2 = make((num_experts, hidden_size, intermediate_size), generator, device)
    weights = ExpertWeights(w1, s1, w3, s3, w2, s2, fmt)
    offsets = random_expert_layout(num_rows, num_experts, torch.Generator().manual_seed(seed), num_empty=num_empty)
    dequant = reference.dequant_fp4 if fmt == WeightFormat.FP4_E2M1 else reference.dequant_fp8_blockwise
    # Scale x so that gate/up have a standard deviation of about 8: the clamps at 10 then bite
    # on a good share of the elements, and a kernel that skips or misplaces them fails.
    weight_rms = float(dequant(w1[0], s1[0]).pow(2).mean().sqrt())
    x_std = 8.0 / (weight_rms * hidden_size**0.5)
    x = (torch.randn(num_rows, hidden_size, generator=generator, device=device) * x_std).to(x_dtype)
    row_weights = torch.rand(num_rows, generator=generator, device=device) if with_row_weights else None

    hidden = grouped_gate_up(x, offsets.to(device), weights, swiglu_limit=swiglu_limit, config=gate_up_config)
    out = grouped_down(
        hidden, offsets.to(device), weights, out_dtype=torch.float32, config=down_config,
        row_weights=row_weights,
    )

    def dequantize_expert(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return dequant(w1[e], s1[e]), dequant(w3[e], s3[e]), dequant(w2[e], s2[e])

    ref = reference.grouped_experts_reference(
        x, offsets, dequantize_expert, swiglu_limit=swiglu_limit, row_weights=row_weights,
        intermediate_dtype=x_dtype,
    )
    error, finite = _relative_error(out.cpu(), ref.cpu())
    name = (f"grouped_experts {fmt.name} R={num_rows} E={num_experts} D={hidden_size} I={intermediate_size} "
            f"limit={swiglu_limit} x={x_dtype} {gate_up_config} {down_config}")
    tolerance = BF16_TOLERANCE if x_dtype != torch.float32 else _tolerance(x_dtype, False, device)
    return CheckResult(name, error, tolerance, finite)


Case = tuple[str, Callable[[], CheckResult]]


def interpret_cases() -> list[Case]:
    """Small shapes with ragged edges, split-K, empty experts, both weight formats (~10 s interpreted)."""
    from moemesh.common.kernels.fp4_experts import Fp4Decode, GroupedGemmConfig
    from moemesh.common.kernels.fp8_linear_config import Fp8LinearConfig

    bf16, f32 = torch.bfloat16, torch.float32
    small = GroupedGemmConfig(block_m=16, block_n=16, block_k=64)
    wide_k = GroupedGemmConfig(block_m=16, block_n=32, block_k=128)
    split3 = Fp8LinearConfig(block_n=32, block_t=16, block_k=64, split_k=3)
    halves_split2 = GroupedGemmConfig(block_m=16, block_n=16, block_k=32, split_k=2, fp4_decode=Fp4Decode.HALVES)
    fma_m2_split2 = GroupedGemmConfig(block_m=2, block_n=16, block_k=32, split_k=2, fp4_decode=Fp4Decode.FMA)
    fma_m1_split2 = GroupedGemmConfig(block_m=1, block_n=16, block_k=32, split_k=2, fp4_decode=Fp4Decode.FMA)
    fma_m4 = GroupedGemmConfig(block_m=4, block_n=32, block_k=64, fp4_decode=Fp4Decode.FMA)
    halves = GroupedGemmConfig(block_m=16, block_n=32, block_k=64, fp4_decode=Fp4Decode.HALVES)
    fma_t1_split2 = Fp8LinearConfig(block_n=32, block_t=1, block_k=64, split_k=2, use_fma=True)
    fma_t4 = Fp8LinearConfig(block_n=16, block_t=4, block_k=32, use_fma=True)
    return [
        ("fp4_decode_exact_join", lambda: check_fp4_decode_exact(Fp4Decode.JOIN, "cpu")),
        ("fp4_decode_exact_halves", lambda: check_fp4_decode_exact(Fp4Decode.HALVES, "cpu")),
        ("fp4_halves_split2_fma_split2", lambda: check_grouped_experts(
            9, 6, 128, 64, num_empty=2, gate_up_config=halves_split2, down_config=fma_m1_split2, seed=9)),
        ("fp4_fma_m1_fma_m2_split2", lambda: check_grouped_experts(
            7, 5, 64, 64, num_empty=1, gate_up_config=fma_m1_split2, down_config=fma_m2_split2, seed=15)),
        ("fp4_fma_halves_fp32", lambda: check_grouped_experts(
            40, 3, 64, 64, swiglu_limit=None, x_dtype=f32, gate_up_config=fma_m4, down_config=halves, seed=10)),
        ("fp8_fma_t1_split2", lambda: check_fp8_linear(1, 96, 256, config=fma_t1_split2, seed=12)),
        ("fp8_fma_t4_bf16_out", lambda: check_fp8_linear(3, 130, 200, out_dtype=bf16, config=fma_t4, seed=13)),
        ("fp8_experts_fma_m2", lambda: check_grouped_experts(
            7, 4, 128, 128, weight_format=1, gate_up_config=fma_m1_split2, down_config=fma_m4, seed=14)),
        ("fp8_experts_split2", lambda: check_grouped_experts(
            12, 4, 128, 128, weight_format=1, num_empty=1, gate_up_config=halves_split2, down_config=halves_split2,
            seed=11)),
        ("fp8_decode_ragged", lambda: check_fp8_linear(3, 200, 300, seed=1)),  # heuristic: split-K, ragged N, K
        ("fp8_split3_bk64", lambda: check_fp8_linear(5, 256, 512, config=split3, seed=2)),
        ("fp8_prefill_fp32", lambda: check_fp8_linear(70, 130, 260, x_dtype=f32, seed=3)),
        ("fp8_bf16_out", lambda: check_fp8_linear(17, 96, 256, out_dtype=bf16, seed=4)),
        ("fp4_experts_clamp", lambda: check_grouped_experts(
            9, 6, 128, 64, num_empty=2, gate_up_config=small, down_config=small, seed=5)),
        ("fp4_experts_noclamp_fp32", lambda: check_grouped_experts(
            40, 3, 64, 64, swiglu_limit=None, with_row_weights=False, x_dtype=f32,
            gate_up_config=small, down_config=small, seed=6)),
        ("fp8_experts_clamp", lambda: check_grouped_experts(
            12, 4, 128, 128, weight_format=1, num_empty=1, gate_up_config=small, down_config=wide_k, seed=7)),
        ("fp8_experts_fp32_default_cfg", lambda: check_grouped_experts(
            20, 5, 256, 128, weight_format=1, x_dtype=f32, seed=8)),
    ]


def cuda_cases() -> list[Case]:
    """V4-Flash shapes on a CUDA device, decode and prefill schedules."""
    from moemesh.common.kernels.expert_configs import Fp4Decode, GroupedGemmConfig

    cases: list[Case] = []
    for num_tokens in (1, 7, 64, 2048):
        for out_features, in_features in ((1024, 4096), (32768, 1024), (4096, 8192)):
            cases.append((f"fp8_T{num_tokens}_{out_features}x{in_features}",
                          lambda t=num_tokens, n=out_features, k=in_features:
                          check_fp8_linear(t, n, k, device="cuda", seed=t)))
    cases.append(("fp8_T33_512x4096_fp32", lambda: check_fp8_linear(
        33, 512, 4096, x_dtype=torch.float32, device="cuda", seed=11)))
    cases.append(("fp4_decode_exact_asm", lambda: check_fp4_decode_exact(Fp4Decode.ASM, "cuda")))
    cases.append(("fp4_decode_exact_asm_folded", lambda: check_fp4_decode_exact(Fp4Decode.ASM_FOLDED, "cuda")))
    cases.append(("fp4_decode_exact_asm_quad", lambda: check_fp4_decode_exact(Fp4Decode.ASM_QUAD, "cuda")))
    cases.append(("fp4_decode_exact_halves", lambda: check_fp4_decode_exact(Fp4Decode.HALVES, "cuda")))
    for num_tokens, out_features, in_features in ((1, 32768, 1024), (64, 4096, 8192), (2048, 1024, 4096)):
        cases.append((f"fp8_asm_quad_T{num_tokens}_{out_features}x{in_features}",
                      lambda t=num_tokens, n=out_features, k=in_features: check_fp8_linear(
                          t, n, k, config=_asm_quad_config(t, n, k), device="cuda", seed=t + 1)))
    cases.append(("fp8_T1_split8_twice", lambda: check_fp8_linear_repeatable(1, 4096, 8192, split_k=8)))
    for num_rows, num_experts, fmt in ((6, 256, 0), (384, 256, 0), (12288, 256, 0), (6, 16, 1), (4096, 16, 1)):
        cases.append((f"experts_fmt{fmt}_R{num_rows}_E{num_experts}",
                      lambda r=num_rows, e=num_experts, f=fmt: check_grouped_experts(
                          r, e, 4096, 2048, weight_format=f, device="cuda", seed=r + f)))
    for num_rows, config in ((6, GroupedGemmConfig(16, 64, 128, 4, 3, 2, Fp4Decode.ASM_QUAD)),
                             (4096, GroupedGemmConfig(64, 128, 64, 8, 3, 1, Fp4Decode.ASM_QUAD))):
        cases.append((f"experts_fmt1_asm_quad_R{num_rows}", lambda r=num_rows, c=config: check_grouped_experts(
            r, 16, 4096, 2048, weight_format=1, gate_up_config=c, down_config=c, device="cuda", seed=r + 9)))
    for label, num_rows, config in expert_variant_configs():
        cases.append((f"experts_R{num_rows}_{label}", lambda r=num_rows, c=config: check_grouped_experts(
            r, 256, 4096, 2048, gate_up_config=c, down_config=c, device="cuda", seed=r + 3)))
    return cases


def _asm_quad_config(num_tokens: int, out_features: int, in_features: int):
    import dataclasses

    from moemesh.common.kernels.fp8_linear_config import choose_fp8_linear_config

    heuristic = choose_fp8_linear_config(num_tokens, out_features, in_features)
    return dataclasses.replace(heuristic, asm_decode=True, asm_quad=True, use_fma=False)


def check_fp4_decode_exact(decode, device: str) -> CheckResult:
    """The decoder against the reference over every byte value: the error is the mismatch count."""
    from moemesh.bench.checks.fp4_decode_probe import mismatches

    return CheckResult(f"fp4 decode {decode.name} exact on {device}", float(mismatches(decode, device)), 0.0, True)


def expert_variant_configs() -> list[tuple[str, int, object]]:
    """Every FP4 decode mode and split-K at the decode and prefill row counts (CUDA cases)."""
    from moemesh.common.kernels.fp4_experts import Fp4Decode, GroupedGemmConfig

    out = []
    for decode in (Fp4Decode.ASM_QUAD, Fp4Decode.ASM_QUAD_WORD_SCALES, Fp4Decode.ASM_FOLDED, Fp4Decode.DOT_SCALED,
                   Fp4Decode.ASM, Fp4Decode.FMA, Fp4Decode.HALVES):
        block_m = 2 if decode == Fp4Decode.FMA else 16
        out.append((f"{decode.name.lower()}_split4", 6, GroupedGemmConfig(
            block_m=block_m, block_n=64, block_k=128, split_k=4, fp4_decode=decode)))
        out.append((decode.name.lower(), 384, GroupedGemmConfig(block_m=block_m, block_n=64, fp4_decode=decode)))
    for decode in (Fp4Decode.ASM_QUAD, Fp4Decode.ASM_QUAD_WORD_SCALES, Fp4Decode.ASM_FOLDED, Fp4Decode.DOT_SCALED,
                   Fp4Decode.ASM, Fp4Decode.HALVES):
        block_k = 128 if decode == Fp4Decode.ASM_QUAD_WORD_SCALES else 64
        out.append((f"{decode.name.lower()}_prefill", 12288, GroupedGemmConfig(
            block_m=64, block_n=128, block_k=block_k, num_warps=8, fp4_decode=decode)))
    return out


def check_fp8_linear_repeatable(num_tokens: int, out_features: int, in_features: int, *, split_k: int) -> CheckResult:
    """Split-K twice in a row on CUDA: both right (the counters reset) and bitwise equal (fixed-order sum)."""
    from moemesh.common.kernels.fp8_linear import fp8_linear
    from moemesh.common.kernels.fp8_linear_config import Fp8LinearConfig

    config = Fp8LinearConfig(block_n=64, block_t=16, split_k=split_k)
    generator = torch.Generator(device="cuda").manual_seed(5)
    weight, scale = random_fp8_weight((out_features, in_features), generator, "cuda")
    x = torch.randn(num_tokens, in_features, generator=generator, device="cuda").to(torch.bfloat16)
    first = fp8_linear(x, weight, scale, out_dtype=torch.float32, config=config)
    second = fp8_linear(x, weight, scale, out_dtype=torch.float32, config=config)
    ref = reference.fp8_linear_reference(x, weight, scale)
    error, finite = _relative_error(second.cpu(), ref.cpu())
    if not torch.equal(first, second):
        error = float("inf")
    return CheckResult(f"fp8_linear split_k={split_k} twice T={num_tokens}", error, TIGHT_TOLERANCE, finite)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("interpret", "cuda"), required=True)
    args = parser.parse_args(argv)
    patch_interpreter_bf16_dot()
    cases = interpret_cases() if args.suite == "interpret" else cuda_cases()
    results = []
    for case_id, run_case in cases:
        result = run_case()
        results.append(result)
        print(json.dumps({"case_id": case_id, **asdict(result), "passed": result.passed}), flush=True)
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
