"""Quantized-weight kernels on CUDA at V4-Flash shapes: achieved bandwidth and rate vs measured ceilings.

Usage: python -m bench.kernels [--out-dir DIR] [--quick]

Measures, in the same run and on the same device: the device-to-device copy bandwidth (bytes
read + written), the bf16 matmul rate (8192^3, random data), then for each shape the Triton
kernel's median time (triton.testing.do_bench, which clears L2 before every call, so weights come
from HBM), its achieved bandwidth (the fewest bytes it must move / time) and, for prefill shapes,
its TFLOP/s; and the same for torch's dequantise-then-matmul and for a bf16 weight already
dequantised (cuBLAS, twice the FP8 bytes). Prints a table and writes bench/results/kernels-*.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FP8_SHAPES = {  # name: (N out, K in)
    "wq_a": (1024, 4096),
    "wq_b": (32768, 1024),
    "wkv": (512, 4096),
    "wo_b": (4096, 8192),
    "shared_w1": (2048, 4096),
    "shared_w2": (4096, 2048),
}
HIDDEN, EXPERT_WIDTH, NUM_EXPERTS, TOP_K = 4096, 2048, 256, 6


L2_DEFEAT_BYTES = 256 * 1024**2  # > 4x the H200's 60 MB L2
MAX_COPIES = 64


def _bench(fn, rep_ms: int = 100) -> float:
    """do_bench median in seconds (clears L2 before each call; includes host launch overhead)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e-3


def _bench_graph(fns, num_replays: int = 30) -> float:
    """Median device seconds per call of one CUDA-graph replay that calls every fn once.

    Each fn works on its own copy of the weights (enough copies to exceed L2 several times), so
    the weights stream from HBM, and the graph removes the Python launch overhead: this is the
    kernel's own time, as a graph-captured decode step would see it.
    """
    import statistics

    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    samples = []
    for _ in range(num_replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / len(fns))
    del graph
    return statistics.median(samples)


def _num_copies(weight_bytes: int) -> int:
    return max(1, min(MAX_COPIES, -(-L2_DEFEAT_BYTES // weight_bytes)))


def measure_ceilings() -> dict:
    import torch

    num_bytes = 2 * 1024**3
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _bench(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = _bench(lambda: a @ b)
    return {"copy_bytes_per_s": 2 * num_bytes / copy_s, "bf16_flops_per_s": 2 * 8192**3 / mm_s}


def _torch_fp8_dequant_matmul(x, weight, scale):
    import torch

    num_out, num_in = weight.shape
    factors = scale.view(torch.float8_e8m0fnu).to(torch.bfloat16)
    factors = factors.repeat_interleave(128, 0)[:num_out].repeat_interleave(128, 1)[:, :num_in]
    return x @ (weight.to(torch.bfloat16) * factors).T


def bench_fp8_linear(ceilings: dict, quick: bool) -> list[dict]:
    import torch

    from common.kernels.checks import random_fp8_weight
    from common.kernels.fp8_linear import Fp8LinearConfig, choose_fp8_linear_config, device_num_sms, fp8_linear

    rows = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    num_sms = device_num_sms(torch.device("cuda"))
    for name, (num_out, num_in) in FP8_SHAPES.items():
        copies = [random_fp8_weight((num_out, num_in), generator, "cuda") for _ in range(_num_copies(num_out * num_in))]
        for num_tokens in (1, 64, 2048):
            x = torch.randn(num_tokens, num_in, device="cuda", dtype=torch.bfloat16)
            heuristic = choose_fp8_linear_config(num_tokens, num_out, num_in, num_sms)
            candidates = [heuristic]
            if not quick and num_tokens == 1:
                candidates += [Fp8LinearConfig(block_n=bn, block_t=16, split_k=sk, num_warps=4, num_stages=4)
                               for bn, sk in ((32, heuristic.split_k), (128, heuristic.split_k), (64, 1))]
            if not quick and num_tokens == 2048:
                candidates += [Fp8LinearConfig(block_n=128, block_t=64, num_warps=4, num_stages=4),
                               Fp8LinearConfig(block_n=64, block_t=128, num_warps=4, num_stages=4),
                               Fp8LinearConfig(block_n=128, block_t=128, block_k=64, num_warps=8, num_stages=4)]
            scale_bytes = copies[0][1].numel()
            min_bytes = num_out * num_in + scale_bytes + 2 * num_tokens * (num_in + num_out)
            flops = 2 * num_tokens * num_out * num_in
            times = {}
            for config in dict.fromkeys(candidates):
                times[str(config)] = _bench_graph(
                    [lambda w=w, s=s, c=config: fp8_linear(x, w, s, config=c) for w, s in copies])
            best_config = min(times, key=times.get)
            kernel_s = times[str(heuristic)]
            host_s = _bench(lambda: fp8_linear(x, copies[0][0], copies[0][1]))
            torch_s = _bench_graph([lambda w=w, s=s: _torch_fp8_dequant_matmul(x, w, s) for w, s in copies[:8]])
            w_bf16 = [w.to(torch.bfloat16) for w, _ in copies[: max(1, len(copies) // 2)]]
            bf16_s = _bench_graph([lambda w=w: x @ w.T for w in w_bf16])
            rows.append({
                "kernel": "fp8_linear", "shape": f"{name} T={num_tokens}", "num_tokens": num_tokens,
                "min_bytes": min_bytes, "flops": flops, "kernel_s": kernel_s, "best_s": times[best_config],
                "best_config": best_config, "do_bench_with_host_overhead_s": host_s,
                "torch_dequant_matmul_s": torch_s, "bf16_weight_matmul_s": bf16_s, "all_configs_s": times,
                "num_weight_copies": len(copies),
                "floor_s": max(min_bytes / ceilings["copy_bytes_per_s"], flops / ceilings["bf16_flops_per_s"]),
            })
            del w_bf16
        del copies
    return rows


def _routed_rows(num_tokens: int, generator):
    import torch

    scores = torch.rand(num_tokens, NUM_EXPERTS, device="cuda", generator=generator)
    return scores.topk(TOP_K, dim=1).indices


def _torch_experts(x_sorted, offsets, weights, swiglu_limit):
    """Torch baseline: per active expert, dequantise to bf16 and matmul."""
    import torch

    from common.kernels.reference import dequant_fp4

    out = torch.empty(x_sorted.shape[0], HIDDEN, device="cuda", dtype=torch.bfloat16)
    bounds = offsets.tolist()
    for e in range(NUM_EXPERTS):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        xe = x_sorted[lo:hi]
        gate = xe @ dequant_fp4(weights.w1[e], weights.s1[e]).to(torch.bfloat16).T
        up = xe @ dequant_fp4(weights.w3[e], weights.s3[e]).to(torch.bfloat16).T
        h = torch.nn.functional.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)
        out[lo:hi] = h @ dequant_fp4(weights.w2[e], weights.s2[e]).to(torch.bfloat16).T
    return out


def bench_fp4_experts(ceilings: dict, quick: bool) -> list[dict]:
    import torch

    from common.kernels.checks import random_fp4_weight
    from common.kernels.fp4_experts import (
        ExpertWeights, GroupedGemmConfig, WeightFormat, grouped_down, grouped_experts, grouped_gate_up,
    )
    from common.kernels.moe_layout import sort_by_expert

    generator = torch.Generator(device="cuda").manual_seed(1)
    w1, s1 = random_fp4_weight((NUM_EXPERTS, EXPERT_WIDTH, HIDDEN), generator, "cuda")
    w3, s3 = random_fp4_weight((NUM_EXPERTS, EXPERT_WIDTH, HIDDEN), generator, "cuda")
    w2, s2 = random_fp4_weight((NUM_EXPERTS, HIDDEN, EXPERT_WIDTH), generator, "cuda")
    weights = ExpertWeights(w1, s1, w3, s3, w2, s2, WeightFormat.FP4_E2M1)
    bytes_per_expert = sum(t[0].numel() for t in (w1, s1, w3, s3, w2, s2))
    rows = []
    for num_tokens in (1, 64, 2048):
        layout = sort_by_expert(_routed_rows(num_tokens, generator), NUM_EXPERTS)
        num_rows = num_tokens * TOP_K
        x_sorted = torch.randn(num_rows, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.05
        offsets = layout.expert_offsets
        num_active = int((offsets[1:] > offsets[:-1]).sum())
        min_bytes = num_active * bytes_per_expert + 2 * num_rows * HIDDEN * 2
        flops = 2 * num_rows * 3 * HIDDEN * EXPERT_WIDTH
        hidden = grouped_gate_up(x_sorted, offsets, weights, swiglu_limit=10.0)
        times = {"heuristic": _bench_graph([lambda: grouped_experts(x_sorted, offsets, weights, swiglu_limit=10.0)])}
        gate_up_s = _bench_graph([lambda: grouped_gate_up(x_sorted, offsets, weights, swiglu_limit=10.0)])
        down_s = _bench_graph([lambda: grouped_down(hidden, offsets, weights)])
        host_s = _bench(lambda: grouped_experts(x_sorted, offsets, weights, swiglu_limit=10.0))
        if not quick:
            alternatives = ((16, 16, 128, 4), (16, 64, 128, 4), (32, 32, 128, 4)) if num_tokens <= 64 else \
                ((64, 128, 64, 8), (128, 64, 64, 8), (64, 64, 128, 4))
            for bm, bn, bk, nw in alternatives:
                config = GroupedGemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=3)
                times[str(config)] = _bench_graph([lambda c=config: grouped_down(
                    grouped_gate_up(x_sorted, offsets, weights, swiglu_limit=10.0, config=c), offsets, weights,
                    config=c)])
        best = min(times, key=times.get)
        # Host-synchronising (offsets.tolist()), so not graph-capturable: do_bench, L2 cleared.
        torch_s = _bench(lambda: _torch_experts(x_sorted, offsets, weights, 10.0), rep_ms=300)
        rows.append({
            "kernel": "fp4_experts", "shape": f"T={num_tokens} rows={num_rows} experts={num_active}",
            "num_tokens": num_tokens, "min_bytes": min_bytes, "flops": flops, "kernel_s": times["heuristic"],
            "best_s": times[best], "best_config": best, "gate_up_s": gate_up_s, "down_s": down_s,
            "do_bench_with_host_overhead_s": host_s,
            "torch_dequant_matmul_s": torch_s, "all_configs_s": times,
            "floor_s": max(min_bytes / ceilings["copy_bytes_per_s"], flops / ceilings["bf16_flops_per_s"]),
        })
    return rows


def print_table(ceilings: dict, rows: list[dict]) -> None:
    print(f"copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 mm {ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")
    print(f"{'kernel':12} {'shape':34} {'us':>8} {'best':>8} {'floor':>8} {'TB/s':>6} {'%copy':>6} "
          f"{'TFLOP/s':>8} {'%mm':>5} {'torch us':>9} {'x torch':>7}")
    for row in rows:
        bandwidth = row["min_bytes"] / row["kernel_s"]
        rate = row["flops"] / row["kernel_s"]
        print(f"{row['kernel']:12} {row['shape']:34} {row['kernel_s'] * 1e6:8.1f} {row['best_s'] * 1e6:8.1f} "
              f"{row['floor_s'] * 1e6:8.1f} {bandwidth / 1e12:6.2f} {100 * bandwidth / ceilings['copy_bytes_per_s']:6.1f} "
              f"{rate / 1e12:8.1f} {100 * rate / ceilings['bf16_flops_per_s']:5.1f} "
              f"{row['torch_dequant_matmul_s'] * 1e6:9.1f} {row['torch_dequant_matmul_s'] / row['kernel_s']:7.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None, help="where the JSON goes (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="heuristic configs only, no sweep")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA device", file=sys.stderr)
        return 2
    from bench.results_io import write_result

    ceilings = measure_ceilings()
    rows = bench_fp8_linear(ceilings, args.quick) + bench_fp4_experts(ceilings, args.quick)
    print_table(ceilings, rows)
    ratios = {
        f"{row['kernel']} {row['shape']}": {
            "bandwidth_vs_copy": row["min_bytes"] / row["kernel_s"] / ceilings["copy_bytes_per_s"],
            "rate_vs_bf16_mm": row["flops"] / row["kernel_s"] / ceilings["bf16_flops_per_s"],
            "speedup_vs_torch": row["torch_dequant_matmul_s"] / row["kernel_s"],
            "time_vs_floor": row["kernel_s"] / row["floor_s"],
        }
        for row in rows
    }
    path = write_result("kernels", {"ceilings": ceilings, "rows": rows}, ratios, out_dir=args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
