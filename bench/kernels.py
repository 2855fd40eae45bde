"""Quantized-weight kernels on CUDA at V4-Flash shapes: achieved bandwidth and rate vs measured ceilings.

Usage: python -m moemesh.bench.kernels [--out-dir DIR] [--quick]

Measures, in the same run and on the same device: the device-to-device copy bandwidth (bytes
read + written), the bf16 matmul rate (8192^3, random data), then for each shape the Triton
kernel's median time (triton.testing.do_bench, which clears L2 before every call, so weights come
from HBM), its achieved bandwidth (the fewest bytes it must move / time) and, for prefill shapes,
its TFLOP/s; and the same for torch's dequantise-then-matmul and for a bf16 weight already
dequantised (cuBLAS, twice the FP8 bytes). Prints a table and writes bench/results/kernels-*.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from moemesh.bench.timing import floor_ratio, floor_s, graph_median_s, l2_cleared_s

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


def _num_copies(weight_bytes: int) -> int:
    return max(1, min(MAX_COPIES, -(-L2_DEFEAT_BYTES // weight_bytes)))


def measure_ceilings() -> dict:
    import torch

    num_bytes = 2 * 1024**3
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = l2_cleared_s(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = l2_cleared_s(lambda: a @ b)
    return {"copy_bytes_per_s": 2 * num_bytes / copy_s, "bf16_flops_per_s": 2 * 8192**3 / mm_s}


def _torch_fp8_dequant_matmul(x, weight, scale):
    import torch

    num_out, num_in = weight.shape
    factors = scale.view(torch.float8_e8m0fnu).to(torch.bfloat16)
    factors = factors.repeat_interleave(128, 0)[:num_out].repeat_interleave(128, 1)[:, :num_in]
    return x @ (weight.to(torch.bfloat16) * factors).T


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_sweep_configs(num_tokens: int, heuristic) -> list:
    """fp8_linear variants beside the heuristic: the inline-PTX quad decode on the heuristic's tiles
    and narrower ones, no split-K (one launch, no workspace), and the FMA GEMV at one token."""
    from moemesh.common.kernels.fp8_linear_config import Fp8LinearConfig

    quad = dict(asm_decode=True, asm_quad=True, use_fma=False)
    configs = [dataclasses.replace(heuristic, **quad)]
    if num_tokens <= 64:
        configs += [dataclasses.replace(heuristic, block_n=32, **quad),
                    dataclasses.replace(heuristic, block_n=32, split_k=2 * heuristic.split_k, **quad),
                    dataclasses.replace(heuristic, block_n=32, split_k=1, **quad),
                    dataclasses.replace(heuristic, block_n=64, split_k=1, **quad),
                    dataclasses.replace(heuristic, split_k=1)]
    if num_tokens == 1:
        configs += [Fp8LinearConfig(block_n=16, block_t=1, split_k=1, num_warps=2, num_stages=4, use_fma=True),
                    Fp8LinearConfig(block_n=32, block_t=1, split_k=heuristic.split_k, num_warps=4, num_stages=4,
                                    use_fma=True)]
    if num_tokens > 64:
        configs += [Fp8LinearConfig(block_n=128, block_t=128, block_k=64, num_warps=8, num_stages=4, **quad),
                    Fp8LinearConfig(block_n=128, block_t=128, block_k=128, num_warps=8, num_stages=3, **quad),
                    Fp8LinearConfig(block_n=64, block_t=128, block_k=128, num_warps=4, num_stages=4, **quad)]
    return configs


def bench_fp8_linear(ceilings: dict, quick: bool, no_baselines: bool = False,
                     token_counts: tuple[int, ...] = (1, 64, 2048)) -> list[dict]:
    import torch

    from moemesh.bench.checks.quantized_kernels import random_fp8_weight
    from moemesh.common.kernels.fp8_linear import fp8_linear
    from moemesh.common.kernels.fp8_linear_config import Fp8LinearConfig, choose_fp8_linear_config, device_num_sms

    rows = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    num_sms = device_num_sms(torch.device("cuda"))
    for name, (num_out, num_in) in FP8_SHAPES.items():
        copies = [random_fp8_weight((num_out, num_in), generator, "cuda") for _ in range(_num_copies(num_out * num_in))]
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, num_in, device="cuda", dtype=torch.bfloat16)
            heuristic = choose_fp8_linear_config(num_tokens, num_out, num_in, num_sms)
            candidates = [heuristic] + ([] if quick else fp8_sweep_configs(num_tokens, heuristic))
            scale_bytes = copies[0][1].numel()
            min_bytes = num_out * num_in + scale_bytes + 2 * num_tokens * (num_in + num_out)
            flops = 2 * num_tokens * num_out * num_in
            times = {}
            for config in dict.fromkeys(candidates):
                if config.split_k > triton_cdiv(num_in, config.block_k):
                    continue
                times[str(config)] = graph_median_s(
                    [lambda w=w, s=s, c=config: fp8_linear(x, w, s, config=c) for w, s in copies])
                print(f"fp8 {name} T={num_tokens} {config}: {times[str(config)] * 1e6:.1f} us", flush=True)
            best_config = min(times, key=times.get)
            kernel_s = times[str(heuristic)]
            host_s = l2_cleared_s(lambda: fp8_linear(x, copies[0][0], copies[0][1]))
            torch_s = float("nan") if no_baselines else graph_median_s(
                [lambda w=w, s=s: _torch_fp8_dequant_matmul(x, w, s) for w, s in copies[:8]])
            w_bf16 = [w.to(torch.bfloat16) for w, _ in copies[: max(1, len(copies) // 2)]]
            bf16_s = graph_median_s([lambda w=w: x @ w.T for w in w_bf16])
            print(f"fp8 {name} T={num_tokens} cuBLAS bf16 weight: {bf16_s * 1e6:.1f} us", flush=True)
            rows.append({
                "kernel": "fp8_linear", "shape": f"{name} T={num_tokens}", "num_tokens": num_tokens,
                "min_bytes": min_bytes, "flops": flops, "kernel_s": kernel_s, "best_s": times[best_config],
                "best_config": best_config, "do_bench_with_host_overhead_s": host_s,
                "torch_dequant_matmul_s": torch_s, "bf16_weight_matmul_s": bf16_s, "all_configs_s": times,
                "num_weight_copies": len(copies),
                "floor_s": max(floor_s(min_bytes, ceilings["copy_bytes_per_s"]), floor_s(flops, ceilings["bf16_flops_per_s"])),
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

    from moemesh.common.kernels.reference import dequant_fp4

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


def fp4_sweep_configs(num_tokens: int, sweep: str) -> list:
    """Variants timed per launch (gate-up and down apart); `sweep` none | small | full.

    ASM_QUAD is the fastest FP4 decode at every shape (DOT_SCALED and FMA far behind); "small" sweeps
    ASM_QUAD's tile shape, K step, warps and stages, "full" adds the other decodes, "prefill" the taller
    row tiles that pay once experts see ~100+ rows (8K-token prefill)."""
    from moemesh.common.kernels.fp4_experts import Fp4Decode as D
    from moemesh.common.kernels.fp4_experts import GroupedGemmConfig as C

    if sweep == "none":
        return []
    q = D.ASM_QUAD
    if sweep == "prefill":  # taller row tiles once experts see ~100+ rows (8K-token prefill)
        return [C(128, 128, 64, 8, 3, 1, q), C(128, 64, 64, 8, 3, 1, q), C(128, 128, 64, 8, 4, 1, q),
                C(128, 64, 128, 8, 3, 1, q)]
    if num_tokens <= 64:
        configs = [C(16, 64, 128, 4, 3, 1, q), C(16, 64, 256, 4, 3, 1, q), C(16, 128, 128, 4, 3, 1, q),
                   C(16, 64, 128, 4, 4, 1, q), C(16, 64, 128, 4, 2, 1, q), C(16, 256, 128, 8, 3, 1, q),
                   C(16, 128, 256, 8, 3, 1, q), C(16, 32, 128, 4, 3, 1, q)]
        w = D.ASM_QUAD_WORD_SCALES
        configs += [C(16, 64, 128, 4, 3, 1, w), C(16, 64, 128, 4, 4, 1, w), C(16, 128, 128, 4, 3, 1, w)]
        if num_tokens == 1:
            configs += [C(16, 64, 128, 4, 3, 2, w), C(16, 64, 128, 4, 3, 2, q), C(16, 64, 256, 4, 3, 2, q), C(16, 128, 128, 4, 3, 2, q),
                        C(16, 32, 256, 4, 3, 2, q), C(16, 64, 128, 4, 4, 2, q), C(16, 64, 128, 4, 3, 4, q),
                        C(16, 32, 128, 4, 3, 2, q), C(16, 32, 128, 4, 3, 4, q), C(16, 64, 128, 4, 4, 4, q),
                        C(16, 64, 128, 8, 3, 2, q), C(16, 64, 128, 8, 3, 4, q)]
        if sweep == "full":
            configs += [C(16, 64, 128, 4, 3, 1, D.HALVES), C(16, 64, 128, 4, 3, 1, D.ASM_FOLDED),
                        C(16, 64, 128, 4, 3, 1, D.ASM), C(16, 64, 128, 4, 3, 1, D.DOT_SCALED)]
        return configs
    configs = [C(64, 128, 64, 8, 3, 1, q), C(64, 128, 64, 8, 4, 1, q), C(128, 128, 64, 8, 3, 1, q),
               C(64, 256, 64, 8, 3, 1, q), C(128, 64, 64, 8, 3, 1, q), C(64, 128, 128, 8, 2, 1, q),
               C(128, 128, 128, 8, 2, 1, q), C(64, 64, 128, 4, 3, 1, q),
               C(64, 128, 128, 8, 3, 1, D.ASM_QUAD_WORD_SCALES), C(128, 128, 128, 8, 3, 1, D.ASM_QUAD_WORD_SCALES)]
    if sweep == "full":
        configs += [C(64, 128, 64, 8, 3, 1, D.HALVES), C(64, 128, 64, 8, 3, 1, D.ASM)]
    return configs


def bench_fp4_experts(ceilings: dict, quick: bool, no_baselines: bool = False, sweep: str = "full",
                      token_counts: tuple[int, ...] = (1, 64, 2048), decode_name: str | None = None) -> list[dict]:
    """Per token count: the default end to end, then every variant's gate-up and down launch apart
    (an invalid or failing variant is recorded as an error, not fatal), and the best pair; with
    `decode_name` only the variants of that FP4 decode are swept."""
    import torch

    from moemesh.bench.checks.quantized_kernels import random_fp4_weight
    from moemesh.common.kernels.fp4_experts import (
        ExpertWeights, WeightFormat, choose_grouped_config, grouped_down, grouped_experts, grouped_gate_up,
    )
    from moemesh.common.kernels.fp4_experts import GroupedGemmConfig as C
    from moemesh.common.kernels.moe_layout import sort_by_expert

    generator = torch.Generator(device="cuda").manual_seed(1)
    w1, s1 = random_fp4_weight((NUM_EXPERTS, EXPERT_WIDTH, HIDDEN), generator, "cuda")
    w3, s3 = random_fp4_weight((NUM_EXPERTS, EXPERT_WIDTH, HIDDEN), generator, "cuda")
    w2, s2 = random_fp4_weight((NUM_EXPERTS, HIDDEN, EXPERT_WIDTH), generator, "cuda")
    weights = ExpertWeights(w1, s1, w3, s3, w2, s2, WeightFormat.FP4_E2M1)
    bytes_per_expert = sum(t[0].numel() for t in (w1, s1, w3, s3, w2, s2))
    rows = []
    for num_tokens in token_counts:
        layout = sort_by_expert(_routed_rows(num_tokens, generator), NUM_EXPERTS)
        num_rows = num_tokens * TOP_K
        x_sorted = torch.randn(num_rows, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.05
        offsets = layout.expert_offsets
        num_active = int((offsets[1:] > offsets[:-1]).sum())
        min_bytes = num_active * bytes_per_expert + 2 * num_rows * HIDDEN * 2
        flops = 2 * num_rows * 3 * HIDDEN * EXPERT_WIDTH
        hidden = grouped_gate_up(x_sorted, offsets, weights, swiglu_limit=10.0)
        graph_median_s([lambda: grouped_experts(x_sorted, offsets, weights, swiglu_limit=10.0)])  # warm-up, discarded
        default_s = graph_median_s([lambda: grouped_experts(x_sorted, offsets, weights, swiglu_limit=10.0)])
        gate_up_times, down_times, errors = {}, {}, {}
        # None = the default each launch chooses itself; then the JOIN reference configuration, then the sweep.
        join_reference = C(64, 128, 64, 8, 3) if num_rows >= 32 * NUM_EXPERTS else C(16, 64, 128, 4, 3)
        reference_configs = [] if sweep == "prefill" else [join_reference]
        variants = fp4_sweep_configs(num_tokens, "none" if quick else sweep)
        if decode_name is not None:
            reference_configs = []
            variants = [c for c in variants if c.fp4_decode.name.lower() == decode_name.lower()]
        for config in [None, *reference_configs, *variants]:
            label = "default" if config is None else config.short()
            for launch, table, fn in (
                ("gate_up", gate_up_times,
                 lambda c=config: grouped_gate_up(x_sorted, offsets, weights, swiglu_limit=10.0, config=c)),
                ("down", down_times, lambda c=config: grouped_down(hidden, offsets, weights, config=c)),
            ):
                try:
                    table[label] = graph_median_s([fn])
                    print(f"fp4 T={num_tokens} {launch:7} {label:32} {table[label] * 1e6:9.1f} us", flush=True)
                except Exception as exc:  # a variant that does not compile here is a result, not a crash
                    errors[f"{launch} {label}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"fp4 T={num_tokens} {launch:7} {label:32} FAILED {errors[f'{launch} {label}']}", flush=True)
        best_gate_up = min(gate_up_times, key=gate_up_times.get)
        best_down = min(down_times, key=down_times.get)
        best_s = gate_up_times[best_gate_up] + down_times[best_down]
        host_s = l2_cleared_s(lambda: grouped_experts(x_sorted, offsets, weights, swiglu_limit=10.0))
        # Host-synchronising (offsets.tolist()), so not graph-capturable: do_bench, L2 cleared.
        torch_s = float("nan") if no_baselines else l2_cleared_s(
            lambda: _torch_experts(x_sorted, offsets, weights, 10.0), rep_ms=300)
        rows.append({
            "kernel": "fp4_experts", "shape": f"T={num_tokens} rows={num_rows} experts={num_active}",
            "num_tokens": num_tokens, "min_bytes": min_bytes, "flops": flops, "kernel_s": default_s,
            "best_s": best_s, "best_config": f"gate_up {best_gate_up} + down {best_down}",
            "gate_up_s": gate_up_times["default"], "down_s": down_times["default"],
            "default_configs": {
                "gate_up": choose_grouped_config(num_rows, NUM_EXPERTS, out_features=EXPERT_WIDTH).short(),
                "down": choose_grouped_config(num_rows, NUM_EXPERTS, out_features=HIDDEN).short()},
            "gate_up_configs_s": gate_up_times, "down_configs_s": down_times, "config_errors": errors,
            "do_bench_with_host_overhead_s": host_s, "torch_dequant_matmul_s": torch_s,
            "floor_s": max(floor_s(min_bytes, ceilings["copy_bytes_per_s"]), floor_s(flops, ceilings["bf16_flops_per_s"])),
        })
        print(f"fp4 T={num_tokens}: default {default_s * 1e6:.1f} us, best pair {best_s * 1e6:.1f} us "
              f"({best_gate_up} + {best_down}), floor {rows[-1]['floor_s'] * 1e6:.1f} us", flush=True)
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
    parser.add_argument("--only", choices=("all", "fp8", "fp4"), default="all")
    parser.add_argument("--sweep", choices=("none", "small", "full", "prefill"), default="full",
                        help="fp4 variant sweep (prefill: the default against taller row tiles only)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 2048], help="token counts")
    parser.add_argument("--fp8-tokens", type=int, nargs="+", default=None, help="fp8 token counts (default --tokens)")
    parser.add_argument("--no-baselines", action="store_true", help="skip the torch dequantise+matmul baselines")
    parser.add_argument("--fp4-decode", default=None, metavar="NAME",
                        help="sweep only this FP4 decode's variants (e.g. asm_quad) beside the default")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA device", file=sys.stderr)
        return 2
    ceilings = measure_ceilings()
    rows = []
    # One result file per finished unit (kernel, token count), so that a run cut short by its
    # time cap still leaves everything it measured.
    if args.only in ("all", "fp8"):
        for num_tokens in args.fp8_tokens or args.tokens:
            rows += bench_fp8_linear(ceilings, args.quick, args.no_baselines, (num_tokens,))
            _write(ceilings, rows, args.out_dir, f"kernels-fp8-T{num_tokens}")
    if args.only in ("all", "fp4"):
        for num_tokens in args.tokens:
            rows += bench_fp4_experts(ceilings, args.quick, args.no_baselines, args.sweep, (num_tokens,),
                                      decode_name=args.fp4_decode)
            _write(ceilings, rows, args.out_dir, f"kernels-fp4-T{num_tokens}")
    print_table(ceilings, rows)
    return 0


def _write(ceilings: dict, rows: list[dict], out_dir: Path | None, name: str) -> None:
    from moemesh.bench.results_io import write_result

    ratios = {
        f"{row['kernel']} {row['shape']}": {
            "bandwidth_vs_copy": row["min_bytes"] / row["kernel_s"] / ceilings["copy_bytes_per_s"],
            "rate_vs_bf16_mm": row["flops"] / row["kernel_s"] / ceilings["bf16_flops_per_s"],
            "speedup_vs_torch": row["torch_dequant_matmul_s"] / row["kernel_s"],
            "time_vs_floor": floor_ratio(row["kernel_s"], row["floor_s"]),
        }
        for row in rows
    }
    path = write_result(name, {"ceilings": ceilings, "rows": rows}, ratios, out_dir=out_dir)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # device runs saw the process linger after main() returned; results are written by now
