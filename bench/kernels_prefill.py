"""Routed experts at prefill sizes on CUDA: the fused FP4 grouped kernel against dequantise + grouped GEMM.

Usage: python -m moemesh.bench.kernels_prefill [--tokens 2048 8192] [--out-dir DIR]

Same weights and routing as `bench.kernels` (256 V4-Flash experts, 4096 x 2048, FP4; 6 random experts
per token). Per token count: the fused default pair (`fp4_experts.grouped_experts`, CUDA-graph replays),
the dequantise path (`fp4_prefill.grouped_experts_dequant`: eager, host sync included, median of
`--reps` with events), its two parts apart (dequantising all experts; the grouped GEMMs on bf16 weights),
cuBLAS-class bf16 rate for reference (the ceiling measured in the same run), and the relative difference
of the two paths' outputs; then every FP8 linear shape of `bench.kernels` through the fused kernel and
through a transient bf16 weight + cuBLAS (`fp8_dequant`). Writes bench/results/kernels-prefill-*.json.
Legend: T tokens, R = 6T rows, E experts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moemesh.bench.kernels import EXPERT_WIDTH, FP8_SHAPES, HIDDEN, NUM_EXPERTS, TOP_K, _routed_rows, measure_ceilings
from moemesh.bench.timing import graph_median_s, median, time_s


def bench_prefill_experts(ceilings: dict, token_counts, reps: int) -> list[dict]:
    import torch

    from moemesh.bench.checks.quantized_kernels import random_fp4_weight
    from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat, grouped_experts
    from moemesh.common.kernels.fp4_prefill import _swiglu_bf16, dequant_fp4_experts, grouped_experts_dequant
    from moemesh.common.kernels.moe_layout import sort_by_expert

    generator = torch.Generator(device="cuda").manual_seed(1)
    w1, s1 = random_fp4_weight((NUM_EXPERTS, EXPERT_WIDTH, HIDDEN), generator, "cuda")
    w3, s3 = random_fp4_weight((NUM_EXPERTS, EXPERT_WIDTH, HIDDEN), generator, "cuda")
    w2, s2 = random_fp4_weight((NUM_EXPERTS, HIDDEN, EXPERT_WIDTH), generator, "cuda")
    weights = ExpertWeights(w1, s1, w3, s3, w2, s2, WeightFormat.FP4_E2M1)
    fp4_bytes = sum(t.numel() for t in (w1, s1, w3, s3, w2, s2))
    bf16_bytes = 2 * NUM_EXPERTS * 3 * HIDDEN * EXPERT_WIDTH
    rows = []
    for num_tokens in token_counts:
        layout = sort_by_expert(_routed_rows(num_tokens, generator), NUM_EXPERTS)
        num_rows = num_tokens * TOP_K
        x = torch.randn(num_rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.05
        row_weights = torch.rand(num_rows, device="cuda", generator=generator) + 0.1
        offsets = layout.expert_offsets
        flops = 2.0 * num_rows * 3 * HIDDEN * EXPERT_WIDTH

        def fused():
            return grouped_experts(x, offsets, weights, swiglu_limit=10.0, row_weights=row_weights)

        def dequant_path():
            return grouped_experts_dequant(x, offsets, weights, swiglu_limit=10.0, row_weights=row_weights)

        graph_median_s([fused])  # warm-up replay set, discarded (the first replay set runs slow)
        fused_s = graph_median_s([fused])
        print(f"experts T={num_tokens}: fused {fused_s * 1e3:.2f} ms "
              f"({100 * flops / ceilings['bf16_flops_per_s'] / fused_s:.0f} % bf16)", flush=True)
        try:
            dequant_s = median(time_s(dequant_path, "cuda", warmup=1, repeats=reps))
        except RuntimeError as error:  # e.g. no grouped GEMM for this device in this torch: keep the fused row
            rows.append({"num_tokens": num_tokens, "num_rows": num_rows, "flops": flops, "fused_s": fused_s,
                         "dequant_path_error": f"{type(error).__name__}: {error}"[:1000]})
            print(f"  dequant path failed: {rows[-1]['dequant_path_error'][:300]}", flush=True)
            continue
        error = ((dequant_path().float() - fused().float()).norm() / fused().float().norm()).item()
        # the parts: all experts dequantised (three launches over every expert, 1 GiB chunks), and the
        # GEMMs alone on weights already in bf16 (one chunk of 32 experts' rows, scaled to all)
        chunk = 32
        gate_up_w = torch.empty(chunk, 2 * EXPERT_WIDTH, HIDDEN, dtype=torch.bfloat16, device="cuda")
        down_w = torch.empty(chunk, HIDDEN, EXPERT_WIDTH, dtype=torch.bfloat16, device="cuda")

        def dequant_all():
            for first in range(0, NUM_EXPERTS, chunk):
                last = first + chunk
                dequant_fp4_experts(w1[first:last], s1[first:last], gate_up_w[:, :EXPERT_WIDTH])
                dequant_fp4_experts(w3[first:last], s3[first:last], gate_up_w[:, EXPERT_WIDTH:])
                dequant_fp4_experts(w2[first:last], s2[first:last], down_w)

        dequant_all_s = median(time_s(dequant_all, "cuda", warmup=1, repeats=reps))
        bounds = offsets.tolist()
        chunk_rows = x[:bounds[chunk]]
        ends = offsets[1:chunk + 1].to(torch.int32)

        def gemms_one_chunk():
            h = _swiglu_bf16(torch._grouped_mm(chunk_rows, gate_up_w.transpose(1, 2), offs=ends), 10.0)
            return torch._grouped_mm(h, down_w.transpose(1, 2), offs=ends)

        gemm_chunk_s = median(time_s(gemms_one_chunk, "cuda", warmup=1, repeats=reps))
        gemm_s = gemm_chunk_s * num_rows / max(1, bounds[chunk])
        row = {"num_tokens": num_tokens, "num_rows": num_rows, "flops": flops, "fused_s": fused_s,
               "dequant_path_s": dequant_s, "dequant_all_experts_s": dequant_all_s,
               "grouped_mm_extrapolated_s": gemm_s, "rel_diff_dequant_vs_fused": error,
               "dequant_bytes": fp4_bytes + bf16_bytes,
               "dequant_copy_fraction": (fp4_bytes + bf16_bytes) / ceilings["copy_bytes_per_s"] / dequant_all_s,
               "fused_fraction_of_bf16": flops / ceilings["bf16_flops_per_s"] / fused_s,
               "dequant_path_fraction_of_bf16": flops / ceilings["bf16_flops_per_s"] / dequant_s,
               "grouped_mm_fraction_of_bf16": flops / ceilings["bf16_flops_per_s"] / gemm_s}
        rows.append(row)
        print(f"experts T={num_tokens}: fused {fused_s * 1e3:.2f} ms ({100 * row['fused_fraction_of_bf16']:.0f} % bf16), "
              f"dequant path {dequant_s * 1e3:.2f} ms ({100 * row['dequant_path_fraction_of_bf16']:.0f} %) = "
              f"dequant all {dequant_all_s * 1e3:.2f} ms ({100 * row['dequant_copy_fraction']:.0f} % copy) + "
              f"grouped_mm ~{gemm_s * 1e3:.2f} ms ({100 * row['grouped_mm_fraction_of_bf16']:.0f} %); "
              f"rel diff {error:.2e}", flush=True)
        del x, row_weights, gate_up_w, down_w
        torch.cuda.empty_cache()
    return rows


def bench_prefill_fp8(ceilings: dict, token_counts) -> list[dict]:
    """Per FP8 shape and token count: the fused kernel against dequantise (transient bf16) + cuBLAS,
    both as CUDA-graph replays (neither syncs the host), and the dequantisation alone."""
    import torch

    from moemesh.common.kernels.fp8_dequant import dequant_fp8, fp8_linear_dequant
    from moemesh.common.kernels.fp8_linear import fp8_linear
    from moemesh.common.model.random_init import random_fp8_linear

    generator = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for name, (num_out, num_in) in FP8_SHAPES.items():
        weight, scale = random_fp8_linear(num_out, num_in, generator=generator, device="cuda")
        dequant_s = graph_median_s([lambda: dequant_fp8(weight, scale)])
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, num_in, device="cuda", generator=generator).to(torch.bfloat16)
            kernel_s = graph_median_s([lambda: fp8_linear(x, weight, scale)])
            path_s = graph_median_s([lambda: fp8_linear_dequant(x, weight, scale)])
            flops = 2.0 * num_tokens * num_out * num_in
            error = ((fp8_linear_dequant(x, weight, scale).float() - fp8_linear(x, weight, scale).float()).norm()
                     / fp8_linear(x, weight, scale).float().norm()).item()
            rows.append({"shape": name, "num_out": num_out, "num_in": num_in, "num_tokens": num_tokens,
                         "kernel_s": kernel_s, "dequant_cublas_s": path_s, "dequant_only_s": dequant_s,
                         "kernel_fraction_of_bf16": flops / ceilings["bf16_flops_per_s"] / kernel_s,
                         "dequant_cublas_fraction_of_bf16": flops / ceilings["bf16_flops_per_s"] / path_s,
                         "rel_diff": error})
            print(f"fp8 {name:10} T={num_tokens:5}: kernel {kernel_s * 1e6:7.1f} us "
                  f"({100 * rows[-1]['kernel_fraction_of_bf16']:.0f} % bf16), dequant+cuBLAS {path_s * 1e6:7.1f} us "
                  f"({100 * rows[-1]['dequant_cublas_fraction_of_bf16']:.0f} %; dequant alone {dequant_s * 1e6:.1f}); "
                  f"rel diff {error:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--only", choices=("all", "experts", "fp8"), default="all")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.kernels_prefill needs a CUDA device", file=sys.stderr)
        return 2
    from moemesh.bench.results_io import write_result

    ceilings = measure_ceilings()
    fp8_rows = bench_prefill_fp8(ceilings, args.tokens) if args.only in ("all", "fp8") else []
    rows = bench_prefill_experts(ceilings, args.tokens, args.reps) if args.only in ("all", "experts") else []
    path = write_result("kernels-prefill", {"ceilings": ceilings, "experts": rows, "fp8": fp8_rows},
                        out_dir=args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
