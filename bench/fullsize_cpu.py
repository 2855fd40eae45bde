"""`python -m bench.fullsize_cpu`: throughput of the CPU expert path at V4-Flash width, by thread count.

One layer's worth of FP4 experts (true width: 2048 x 4096, 13.37 MB each) filled as the far worker
fills them, then `services.expert.cpu_experts.expert_rows` timed for decode-sized groups (1 and 8
tokens, 6 slots each over --num-experts experts) at each --threads value, against the host copy
bandwidth measured in the same run; at the largest thread count also `QuantizedRoutedExperts`' own
torch path (whole-matrix dequantisation) for comparison. JSON via bench.results_io ("fullsize-cpu").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        began_s = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began_s)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,8,16,28")
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from bench.fullsize_setup import model_hub_dict
    from bench.fullsize_timing import copy_bandwidth
    from bench.results_io import write_result
    from common.model.config import ModelConfig
    from services.expert.cpu_experts import CpuBlockRunner, expert_rows
    from services.expert.random_weights import ExpertFill, RandomWeightsSpec, build_random_experts, expert_bytes

    config = ModelConfig.from_dict(model_hub_dict(1, tiny=False))
    num_experts = args.num_experts
    experts = build_random_experts(config, [(0, e) for e in range(num_experts)], "cpu", RandomWeightsSpec(),
                                   fill=ExpertFill.POOL)
    held = experts._layers[0]
    bytes_per_expert = expert_bytes(config)
    generator = torch.Generator().manual_seed(0)
    rows = []
    thread_counts = [int(t) for t in args.threads.split(",") if t]
    for num_threads, mode in [(t, m) for t in thread_counts for m in ("pool", "intra_op")]:
        if num_threads == 1 and mode == "intra_op":
            continue
        torch.set_num_threads(num_threads)
        bandwidth = copy_bandwidth(torch.device("cpu"), 1 << 30, reps=3)
        runner = None
        if mode == "pool":  # what the CPU expert worker does: Python threads, single-threaded torch ops
            runner = CpuBlockRunner(num_threads)
            torch.set_num_threads(1)
        for num_tokens in (1, 8):
            hidden = torch.randn(num_tokens, config.hidden_size, generator=generator)
            ids = torch.stack([torch.randperm(num_experts, generator=generator)[:6] for _ in range(num_tokens)])
            ids = ids.sort(dim=1).values
            weights = torch.rand(num_tokens, 6, generator=generator)
            touched = int(torch.unique(ids).numel())
            seconds = _median_s(lambda: expert_rows(held, hidden, ids, weights, None, config.swiglu_limit, False,
                                                    runner), args.reps)
            row = {"threads": num_threads, "mode": mode, "num_tokens": num_tokens, "experts_touched": touched,
                   "s": seconds, "s_per_expert": seconds / touched,
                   "weight_read_bytes_per_s": touched * bytes_per_expert / seconds,
                   "copy_bytes_per_s": bandwidth}
            if num_threads == thread_counts[-1] and num_tokens == 1 and mode == "intra_op":
                torch_s = _median_s(lambda: experts.per_expert_outputs(0, hidden, ids, weights), 1)
                row["torch_path_s"] = torch_s
            rows.append(row)
            print(f"{mode:8} threads {num_threads:>2} tokens {num_tokens}: {touched} experts in {seconds * 1e3:.1f} ms "
                  f"({seconds / touched * 1e3:.2f} ms/expert, {touched * bytes_per_expert / seconds / 1e9:.2f} GB/s "
                  f"of FP4 weights; copy bandwidth {bandwidth / 1e9:.0f} GB/s)"
                  + (f"; torch path {row['torch_path_s'] * 1e3:.0f} ms" if "torch_path_s" in row else ""), flush=True)
        if runner is not None:
            runner.close()
    path = write_result("fullsize-cpu", {"bytes_per_expert": bytes_per_expert, "rows": rows}, out_dir=args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
