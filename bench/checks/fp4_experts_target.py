"""A profiler target: the grouped FP4 expert launches (gate-up, then down) of `--tokens` decode tokens at
V4-Flash size with their default configurations, run `--repeats` times, nothing else on the GPU. Used as

    ncu --clock-control none --kernel-name regex:_grouped_kernel --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \\
        --section SchedulerStats python3 -m moemesh.bench.checks.fp4_experts_target --tokens 1

(bench/results/kernels-fp4-ncu-h200-20261205T052331Z.log is such a run's first two launches after warm-up).
"""

from __future__ import annotations

import argparse

import torch

def main(argv: list[str] | None = None) -> int:
    from moemesh.bench.checks.quantized_kernels import random_fp4_weight
    from moemesh.bench.kernels import EXPERT_WIDTH, HIDDEN, NUM_EXPERTS, TOP_K
    from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat, grouped_down, grouped_gate_up
    from moemesh.common.kernels.moe_layout import sort_by_expert

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    generator = torch.Generator(device="cuda").manual_seed(1)
    w1, s1 = random_fp4_weight((NUM_EXPERTS, EXPERT_WIDTH, HIDDEN), generator, "cuda")
    w3, s3 = random_fp4_weight((NUM_EXPERTS, EXPERT_WIDTH, HIDDEN), generator, "cuda")
    w2, s2 = random_fp4_weight((NUM_EXPERTS, HIDDEN, EXPERT_WIDTH), generator, "cuda")
    weights = ExpertWeights(w1, s1, w3, s3, w2, s2, WeightFormat.FP4_E2M1)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, device="cuda", generator=generator)[:TOP_K]
                       for _ in range(args.tokens)])  # [T, K] distinct experts per token
    offsets = sort_by_expert(ids, NUM_EXPERTS).expert_offsets
    x = torch.randn(args.tokens * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.05
    for _ in range(args.repeats):
        hidden = grouped_gate_up(x, offsets, weights, swiglu_limit=10.0)
        grouped_down(hidden, offsets, weights)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
