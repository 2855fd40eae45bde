"""`python -m moemesh.bench.fullsize_cpu`: throughput of the CPU expert path at V4-Flash width, by thread count.

One layer's worth of FP4 experts (true width: 2048 x 4096, 13.37 MB each; random bytes in memory,
`bench.hostwork.random_held_experts`), then `services.expert.cpu_experts.expert_rows` timed for
decode-sized groups (--tokens, --top-k slots each over --num-experts experts; fresh routing every
repetition, so the experts a call reads are mostly not in the last-level cache) at each --threads value, against the host copy bandwidth
(read + write) measured at the same thread count. Paths (--paths):
- `native`: the C kernel (`common/kernels/cpu_fp4.c`) as the worker runs it (`expert_rows`): one call
  for every expert of the layer, on the work-claiming pool (`cpu_fp4_pool.h`);
- `native_omp`: the same call on the OpenMP executor (a barrier over every thread per phase);
- `native_per_expert`: the kernel called once per expert, pool executor (what a call per expert costs);
- `torch_pool`: the torch blocked path on a pool of Python threads (the fallback), only at the
  largest thread count with one token (it is ~100x slower; the comparison point of earlier runs).
Reports ms per expert touched, GB/s of FP4 weights read and that as a fraction of the copy bandwidth.
JSON via bench.results_io ("fullsize-cpu").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from moemesh.bench.timing import median, time_s

def _times_s(fn, inputs: list) -> list[float]:
    """Sorted wall times of fn(*inputs[i]) over inputs[1:], after a warm-up on inputs[0]."""
    fn(*inputs[0])
    remaining = iter(inputs[1:])
    return sorted(time_s(lambda: fn(*next(remaining)), "cpu", repeats=len(inputs) - 1))


def _read_bandwidth(torch, num_bytes: int, reps: int = 3) -> float:
    """Bytes read per second by an fp32 sum over `num_bytes` (bandwidth-bound; the kernel only reads)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / median(time_s(data.sum, "cpu", warmup=1, repeats=reps))


def _thread_counts(text: str) -> list[int]:
    available = os.cpu_count() or 1
    counts = [available if t == "all" else int(t) for t in text.split(",") if t]
    return sorted({c for c in counts if 0 < c <= available})


def _routings(torch, num_tokens: int, hidden_size: int, num_experts: int, top_k: int, reps: int, generator):
    """reps + 1 (hidden, ids, weights) with fresh random top-k routings."""
    out = []
    for _ in range(reps + 1):
        hidden = torch.randn(num_tokens, hidden_size, generator=generator)
        ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
        out.append((hidden, ids.sort(dim=1).values, torch.rand(num_tokens, top_k, generator=generator)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,8,16,all", help="comma list; 'all' = os.cpu_count()")
    parser.add_argument("--tokens", default="1,8,32")
    parser.add_argument("--paths", default="native,native_omp,native_per_expert,torch_pool")
    parser.add_argument("--num-experts", type=int, default=256,
                        help="experts filled (13.4 MB each); many, so few of a call's experts sit in the L3")
    parser.add_argument("--top-k", type=int, default=6, help="slots per token (experts per call at 1 token); "
                        "a far CPU worker sees ~1-2 of a token's 6 at B = 1")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--spin-us", default=str(50.0),
                        help="comma list of pool idle-poll times (us) for the native path (each measured)")
    parser.add_argument("--copy-bytes", type=int, default=1 << 30)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from moemesh.bench.fullsize_setup import model_hub_dict
    from moemesh.bench.fullsize_timing import copy_bandwidth
    from moemesh.bench.results_io import write_result
    from moemesh.common.kernels import cpu_fp4
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.model.cpu_experts import CpuBlockRunner
    from moemesh.bench.hostwork import random_held_experts
    from moemesh.common.placement.cost import ModelCosts

    config = ModelConfig.from_dict(model_hub_dict(1, tiny=False))
    paths = [p for p in args.paths.split(",") if p]
    native = cpu_fp4.native_kernel() if any(p.startswith("native") for p in paths) else None
    if native is None:
        print(f"native kernel unavailable: {cpu_fp4.unavailable_reason()}", flush=True)
        paths = [p for p in paths if not p.startswith("native")]
    else:
        print(f"native kernel: {native.path} isa {native.isa} openmp {native.has_openmp}", flush=True)
    began_s = time.perf_counter()
    experts = random_held_experts(config, [(0, e) for e in range(args.num_experts)], "cpu")
    held = experts._layers[0]
    print(f"filled {args.num_experts} experts in {time.perf_counter() - began_s:.1f} s", flush=True)
    bytes_per_expert = ModelCosts.from_config(config).bytes_per_expert
    generator = torch.Generator().manual_seed(0)
    thread_counts = _thread_counts(args.threads)
    token_counts = [int(t) for t in args.tokens.split(",") if t]
    spins = [float(v) for v in args.spin_us.split(",") if v]
    rows = []
    for num_threads in thread_counts:
        torch.set_num_threads(num_threads)
        bandwidth = copy_bandwidth(torch.device("cpu"), args.copy_bytes, reps=3)
        read_bandwidth = _read_bandwidth(torch, args.copy_bytes)
        print(f"threads {num_threads}: copy {bandwidth / 1e9:.1f} GB/s (read + write), fp32 sum reads "
              f"{read_bandwidth / 1e9:.1f} GB/s", flush=True)
        torch.set_num_threads(1)  # as the worker: torch single-threaded, the kernel (or pool) has the threads
        for path in paths:
            if path == "torch_pool" and num_threads != thread_counts[-1]:
                continue
            runner = CpuBlockRunner(num_threads, use_native=path.startswith("native"))
            for spin_us in spins if path == "native" else spins[:1]:
                if native is not None:
                    native.set_idle_spin_us(spin_us)
                for num_tokens in token_counts:
                    if path == "torch_pool" and num_tokens != 1:
                        continue
                    row = _measure(path, runner, held, config, native, args, num_tokens, generator)
                    row.update(threads=num_threads, spin_us=spin_us if path.startswith("native") else None,
                               copy_bytes_per_s=bandwidth, sum_read_bytes_per_s=read_bandwidth,
                               fraction_of_copy=row["weight_read_bytes_per_s"] / bandwidth)
                    rows.append(row)
                    print(f"{path:17} threads {num_threads:>3} tokens {num_tokens:>2}"
                          + (f" spin {spin_us:g} us" if len(spins) > 1 and path == "native" else "")
                          + f": {row['experts_touched']:.1f} experts in {row['s'] * 1e3:7.2f} ms (min "
                          f"{row['s_min'] * 1e3:.2f}; {row['s_per_expert'] * 1e3:6.3f} ms/expert, "
                          f"{row['weight_read_bytes_per_s'] / 1e9:6.2f} GB/s of FP4 weights = "
                          f"{row['fraction_of_copy']:5.1%} of copy bandwidth {bandwidth / 1e9:.0f} GB/s)", flush=True)
            runner.close()
    raw = {"bytes_per_expert": bytes_per_expert, "num_experts": args.num_experts, "cpu_count": os.cpu_count(),
           "rows": rows}
    ratios = {f"{r['path']}_t{r['threads']}_tok{r['num_tokens']}_fraction_of_copy": r["fraction_of_copy"]
              for r in rows}
    path = write_result("fullsize-cpu", raw, ratios, out_dir=args.out_dir)
    print(f"wrote {path}")
    return 0


def _measure(path: str, runner, held, config, native, args, num_tokens: int, generator) -> dict:
    """Times one (path, token count) over fresh routings; the row of figures (threads etc. added by the caller)."""
    import torch

    from moemesh.common.kernels import cpu_fp4
    from moemesh.common.model.cpu_experts import expert_rows
    from moemesh.common.placement.cost import ModelCosts

    reps = args.reps if path != "torch_pool" else 2
    inputs = _routings(torch, num_tokens, config.hidden_size, args.num_experts, args.top_k, reps, generator)
    touched = sum(int(torch.unique(ids).numel()) for _, ids, _ in inputs[1:]) / (len(inputs) - 1)
    if path in ("native_per_expert", "native_omp"):
        fn = _direct_fn(runner, held, config, path == "native_per_expert",
                        cpu_fp4.Executor.OPENMP if path == "native_omp" else cpu_fp4.Executor.POOL)
    else:
        def fn(hidden, ids, weights):
            expert_rows(held, hidden, ids, weights, None, config.swiglu_limit, False, runner)
    times = _times_s(fn, inputs)
    seconds = median(times)
    return {"path": path, "num_tokens": num_tokens, "top_k": args.top_k, "experts_touched": touched, "s": seconds,
            "s_min": times[0], "s_max": times[-1], "s_per_expert": seconds / touched,
            "weight_read_bytes_per_s": touched * ModelCosts.from_config(config).bytes_per_expert / seconds,
            "isa": native.isa if native and path.startswith("native") else None}


def _direct_fn(runner, held, config, per_expert: bool, executor):
    """expert_rows' native call made directly with a chosen executor, as one call or one call per expert
    (same rows, same outputs)."""
    import torch

    from moemesh.common.kernels.cpu_fp4 import ExpertGroups, ExpertStacks

    stacks = ExpertStacks.from_tensors(held.w1, held.s1, held.w3, held.s3, held.w2, held.s2)

    def fn(hidden, ids, weights):
        out = torch.zeros(ids.numel(), hidden.shape[1])
        if not per_expert:
            return runner.native.routed_experts(hidden, ids, weights, None, held.local, stacks, config.swiglu_limit,
                                                False, out, runner.num_threads, executor)
        groups = ExpertGroups.from_routing(ids, weights, None, held.local)
        for g in range(groups.stack_ids.numel()):
            one = ExpertGroups(groups.offsets[g:g + 2], groups.stack_ids[g:g + 1], groups.row_tokens,
                               groups.row_weights, groups.row_dest)
            runner.native.experts(hidden, one, stacks, config.swiglu_limit, False, out, runner.num_threads, executor)
        return out

    return fn


if __name__ == "__main__":
    sys.exit(main())
