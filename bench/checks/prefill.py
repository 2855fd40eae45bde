"""Checks of the prefill paths (`fp4_prefill`: routed experts; `fp8_dequant`: FP8 linears) against the
fp32 references.

`python -m moemesh.bench.checks.prefill [--device cpu|cuda]` prints one JSON line per case (CPU: meant
for TRITON_INTERPRET=1, small shapes; CUDA: V4-Flash shapes). Cases: both dequantise kernels bit for bit
against `reference.dequant_fp4` / `dequant_fp8_blockwise` (ragged FP8 edges, a strided FP4 output); the
experts path (chunks smaller than the expert count, empty experts, an empty chunk) against
`grouped_experts_reference`; `Fp8Linear` / `Fp8GroupedLinear` through the dequantise path against fp32.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from moemesh.common.kernels import reference
from moemesh.bench.checks.quantized_kernels import (
    BF16_TOLERANCE, CheckResult, _relative_error, patch_interpreter_bf16_dot, patch_interpreter_bf16_rounding,
    random_expert_layout, random_fp4_weight,
)


def check_dequant_exact(num_experts: int, num_rows: int, num_cols: int, device: str, seed: int = 0) -> CheckResult:
    from moemesh.common.kernels.fp4_prefill import dequant_fp4_experts

    generator = torch.Generator(device=device).manual_seed(seed)
    w, s = random_fp4_weight((num_experts, num_rows, num_cols), generator, device)
    s = torch.randint(100, 140, s.shape, generator=generator, device=device, dtype=torch.uint8)  # wide scales
    out = torch.full((num_experts, num_rows, 2 * num_cols), float("nan"), dtype=torch.bfloat16, device=device)
    dequant_fp4_experts(w, s, out[:, :, num_cols:])  # into the right half of a wider buffer
    exact = torch.equal(out[:, :, num_cols:].float(), reference.dequant_fp4(w, s).float())
    untouched = bool(torch.isnan(out[:, :, :num_cols]).all())
    return CheckResult(f"fp4 dequant E={num_experts} N={num_rows} K={num_cols} (strided out)",
                       0.0 if exact and untouched else 1.0, 0.0, True)


def check_dequant_path(num_rows: int, num_experts: int, hidden: int, inter: int, *, num_empty: int,
                       max_scratch_bytes: int, device: str, seed: int = 0) -> CheckResult:
    from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat
    from moemesh.common.kernels.fp4_prefill import grouped_experts_dequant

    generator = torch.Generator(device=device).manual_seed(seed)
    w1, s1 = random_fp4_weight((num_experts, inter, hidden), generator, device)
    w3, s3 = random_fp4_weight((num_experts, inter, hidden), generator, device)
    w2, s2 = random_fp4_weight((num_experts, hidden, inter), generator, device)
    weights = ExpertWeights(w1, s1, w3, s3, w2, s2, WeightFormat.FP4_E2M1)
    offsets = random_expert_layout(num_rows, num_experts, torch.Generator().manual_seed(seed), num_empty=num_empty)
    weight_rms = float(reference.dequant_fp4(w1[0], s1[0]).pow(2).mean().sqrt())
    x_std = 8.0 / (weight_rms * hidden**0.5)  # gate/up std ~8: the clamps at 10 bite
    x = (torch.randn(num_rows, hidden, generator=generator, device=device) * x_std).to(torch.bfloat16)
    row_weights = torch.rand(num_rows, generator=generator, device=device)
    out = grouped_experts_dequant(x, offsets.to(device), weights, swiglu_limit=10.0, row_weights=row_weights,
                                  max_scratch_bytes=max_scratch_bytes)

    def dequantize_expert(e: int):
        return (reference.dequant_fp4(w1[e], s1[e]), reference.dequant_fp4(w3[e], s3[e]),
                reference.dequant_fp4(w2[e], s2[e]))

    ref = reference.grouped_experts_reference(x, offsets, dequantize_expert, swiglu_limit=10.0,
                                              row_weights=row_weights, intermediate_dtype=torch.bfloat16)
    error, finite = _relative_error(out.float().cpu(), ref.cpu())
    bytes_per_expert = 2 * 3 * hidden * inter
    name = (f"fp4 dequant path R={num_rows} E={num_experts} D={hidden} I={inter} empty={num_empty} "
            f"chunk={max(1, max_scratch_bytes // bytes_per_expert)}")
    return CheckResult(name, error, 2 * BF16_TOLERANCE, finite)  # gate/up rounded to bf16 once more


def check_fp8_dequant_exact(num_rows: int, num_cols: int, device: str, seed: int = 0) -> CheckResult:
    from moemesh.common.kernels.fp8_dequant import dequant_fp8
    from moemesh.common.model.random_init import random_fp8_linear

    weight, scale = random_fp8_linear(num_rows, num_cols, generator=torch.Generator(device=device).manual_seed(seed),
                                      device=device)
    exact = torch.equal(dequant_fp8(weight, scale, torch.float32), reference.dequant_fp8_blockwise(weight, scale))
    return CheckResult(f"fp8 dequant N={num_rows} K={num_cols}", 0.0 if exact else 1.0, 0.0, True)


def check_fp8_linears_dequant_path(num_tokens: int, out_features: int, in_features: int, num_groups: int,
                                   device: str, seed: int = 0) -> CheckResult:
    """Fp8Linear ([T, K]) and Fp8GroupedLinear ([T, G, K]) with MOEMESH_FP8_PREFILL=dequant vs fp32 torch."""
    import os

    from moemesh.common.kernels.fp8_dequant import PATH_ENV
    from moemesh.common.model.quantized import Fp8GroupedLinear, Fp8Linear, KernelBackend
    from moemesh.common.model.random_init import random_fp8_linear

    generator = torch.Generator(device=device).manual_seed(seed)
    weight, scale = random_fp8_linear(out_features, in_features, generator=generator, device=device)
    x = torch.randn(num_tokens, in_features, generator=generator, device=device).to(torch.bfloat16)
    xg = torch.randn(num_tokens, num_groups, in_features, generator=generator, device=device).to(torch.bfloat16)
    previous = os.environ.get(PATH_ENV)
    os.environ[PATH_ENV] = "dequant"
    try:
        out = Fp8Linear(weight, scale, backend=KernelBackend.KERNEL)(x)
        gweight, gscale = random_fp8_linear(num_groups * 128, in_features, generator=generator, device=device)
        gout = Fp8GroupedLinear(gweight, gscale, num_groups, backend=KernelBackend.KERNEL)(xg)
    finally:
        if previous is None:
            os.environ.pop(PATH_ENV, None)
        else:
            os.environ[PATH_ENV] = previous
    ref = Fp8Linear(weight, scale, backend=KernelBackend.TORCH)(x.float())
    gref = Fp8GroupedLinear(gweight, gscale, num_groups, backend=KernelBackend.TORCH)(xg.float())
    error = max(_relative_error(out.float().cpu(), ref.cpu())[0], _relative_error(gout.float().cpu(), gref.cpu())[0])
    finite = bool(torch.isfinite(out).all() and torch.isfinite(gout).all())
    return CheckResult(f"fp8 linears via dequant T={num_tokens} N={out_features} K={in_features} G={num_groups}",
                       error, BF16_TOLERANCE, finite)


def cases(device: str):
    if device == "cpu":
        return [("dequant_exact", lambda: check_dequant_exact(3, 40, 256, device)),
                ("fp8_dequant_exact_ragged", lambda: check_fp8_dequant_exact(200, 300, device)),
                ("fp8_linears_dequant_path", lambda: check_fp8_linears_dequant_path(7, 200, 256, 2, device)),
                ("dequant_path_chunks", lambda: check_dequant_path(
                    50, 7, 256, 256, num_empty=3, max_scratch_bytes=2 * 2 * 3 * 256 * 256, device=device, seed=3))]
    return [("dequant_exact_flash", lambda: check_dequant_exact(4, 2048, 4096, device)),
            ("fp8_dequant_exact_flash", lambda: check_fp8_dequant_exact(32768, 1024, device)),
            ("fp8_linears_dequant_path_flash", lambda: check_fp8_linears_dequant_path(2048, 4096, 8192, 8, device)),
            ("dequant_path_flash", lambda: check_dequant_path(
                12288, 256, 4096, 2048, num_empty=8, max_scratch_bytes=1 << 30, device=device, seed=4))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    patch_interpreter_bf16_dot()  # both no-ops unless TRITON_INTERPRET=1
    patch_interpreter_bf16_rounding()
    failed = 0
    for case_id, run in cases(args.device):
        result = run()
        failed += not result.passed
        print(json.dumps({"case_id": case_id, "name": result.name, "relative_error": result.relative_error,
                          "tolerance": result.tolerance, "passed": result.passed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
