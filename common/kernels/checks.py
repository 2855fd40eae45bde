"""Kernel-vs-reference comparisons on fresh random inputs, shared by the tests and the benchmark.

`python -m common.kernels.checks --suite interpret` runs the small cases (meant for
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

from common.kernels import reference

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
    from common.kernels.fp8_linear import fp8_linear

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
    from common.kernels.fp4_experts import ExpertWeights, WeightFormat, grouped_down, grouped_gate_up

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
    from common.kernels.fp4_experts import GroupedGemmConfig
    from common.kernels.fp8_linear import Fp8LinearConfig

    bf16, f32 = torch.bfloat16, torch.float32
    small = GroupedGemmConfig(block_m=16, block_n=16, block_k=64)
    wide_k = GroupedGemmConfig(block_m=16, block_n=32, block_k=128)
    split3 = Fp8LinearConfig(block_n=32, block_t=16, block_k=64, split_k=3)
    return [
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
    cases: list[Case] = []
    for num_tokens in (1, 7, 64, 2048):
        for out_features, in_features in ((1024, 4096), (32768, 1024), (4096, 8192)):
            cases.append((f"fp8_T{num_tokens}_{out_features}x{in_features}",
                          lambda t=num_tokens, n=out_features, k=in_features:
                          check_fp8_linear(t, n, k, device="cuda", seed=t)))
    cases.append(("fp8_T33_512x4096_fp32", lambda: check_fp8_linear(
        33, 512, 4096, x_dtype=torch.float32, device="cuda", seed=11)))
    for num_rows, num_experts, fmt in ((6, 256, 0), (384, 256, 0), (12288, 256, 0), (6, 16, 1), (4096, 16, 1)):
        cases.append((f"experts_fmt{fmt}_R{num_rows}_E{num_experts}",
                      lambda r=num_rows, e=num_experts, f=fmt: check_grouped_experts(
                          r, e, 4096, 2048, weight_format=f, device="cuda", seed=r + f)))
    return cases


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
