"""`moemesh bench NAME [args...]`: runs one benchmark module from `bench/`; `moemesh bench --list` names them.

`moemesh bench make-checkpoint ... --out DIR` writes a hub-format checkpoint with random weights
(bench.random_checkpoint), the model every full-size benchmark loads from disk.

Each benchmark module defines `main(argv: list[str] | None) -> int`, prints its figures and writes
JSON under bench/results/ (bench.results_io). The figures and what bounds them: docs/performance.md.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """A benchmark entry point: the module whose `main` runs it, arguments always passed first, one line."""

    module: str
    summary: str
    fixed_args: tuple[str, ...] = ()


# benchmark name -> its entry point under the bench package
BENCHMARKS: dict[str, Benchmark] = {
    "layers": Benchmark("moemesh.bench.layers",
                        "N V4-Flash layers on one device: decode steps (CUDA graphs) and prefill against the floor"),
    "layers-disagg": Benchmark("moemesh.bench.layers",
                               "layers with the routed experts in an expert worker process (ZeroMQ, CUDA IPC)",
                               ("--disaggregated",)),
    "layers-kernel-floors": Benchmark("moemesh.bench.layers_kernel_floors",
                                      "each decode kernel of a layers result against the bytes it must read"),
    "layers-profile": Benchmark("moemesh.bench.layers_profile",
                                "torch.profiler of layers' decode steps or prefill: kernels by device time"),
    "kernels": Benchmark("moemesh.bench.kernels",
                         "FP8 linear and FP4 grouped-expert kernels: bandwidth and rate against measured ceilings"),
    "kernels-attention": Benchmark("moemesh.bench.kernels_attention",
                                   "batched attention kernels (decode, prefill) against the torch path and the floor"),
    "kernels-prefill": Benchmark("moemesh.bench.kernels_prefill",
                                 "routed experts at prefill sizes: fused FP4 kernel against dequantise + GEMM"),
    "kernels-fused": Benchmark("moemesh.bench.kernels_fused",
                               "fused per-layer glue (mHC, RMS norm, RoPE, MoE gate) against its torch code"),
    "kernels-drift": Benchmark("moemesh.bench.kernels_drift",
                               "bf16 drift of the quantized model, layer by layer and op by op, against fp32"),
    "attention-sass": Benchmark("moemesh.bench.attention_sass",
                                "compile the attention kernels for sm_90 (no GPU) and summarise their machine code"),
    "attention-graphs": Benchmark("moemesh.bench.attention_graphs",
                                  "the serving attention worker's decode steps, eager against CUDA graphs"),
    "kernel-sass": Benchmark("moemesh.bench.kernel_sass",
                             "compile the grouped expert kernel for sm_90 (no GPU) and summarise its machine code"),
    "dispatch": Benchmark("moemesh.bench.dispatch",
                          "round trip of one Dispatch/Combine per transport against an in-process call"),
    "wire-staging": Benchmark("moemesh.bench.wire_staging",
                              "staged ZeroMQ send on this host: pipelined throughput and ping-pong latency"),
    "hostwork": Benchmark("moemesh.bench.hostwork",
                          "per-Dispatch host work of the expert worker and the attention-side split"),
    "cpu-mailbox": Benchmark("moemesh.bench.cpu_mailbox",
                             "round trip and hop cost per layer of the CPU expert mailbox"),
    "scheduler": Benchmark("moemesh.bench.scheduler_cost",
                           "router scheduler cost per schedule() + update() at 1, 64, 256 sequences"),
    "fullsize": Benchmark("moemesh.bench.fullsize",
                          "V4-Flash at true width through moemesh's processes: tok/s against the bandwidth floor"),
    "fullsize-cpu": Benchmark("moemesh.bench.fullsize_cpu",
                              "CPU FP4 expert path at V4-Flash width by thread count"),
    "fullsize-draft": Benchmark("moemesh.bench.fullsize_draft",
                                "the DSpark drafter at V4-Flash size: propose / add_features against its floor"),
    "fullsize-report": Benchmark("moemesh.bench.fullsize_report",
                                 "markdown tables of fullsize result files (LABEL=FILE ...)"),
    "serve": Benchmark("moemesh.bench.serve",
                       "load a running OpenAI-compatible server: throughput, TTFT, TPOT"),
    "speculation": Benchmark("moemesh.bench.speculation",
                             "tokens/s with speculation off, fixed and adaptive, one server per mode"),
    "soak": Benchmark("moemesh.bench.soak",
                      "long run of streams with client aborts and expert worker restarts: failures, leaks"),
    "default-model": Benchmark("moemesh.bench.default_model_figures",
                               "the default model on the CPU: loss, recitation, drafter acceptance, expert skew"),
    "long-context": Benchmark("moemesh.bench.long_context",
                              "long prompts through a running server: capacity, prefill and decode against floors, "
                              "short-request TTFT during a long prefill"),
    "kv-bytes": Benchmark("moemesh.bench.kv_bytes",
                          "KV bytes per context token as stored (--kv-dtype), measured from a sequence state"),
    "plots": Benchmark("moemesh.bench.plots", "render result JSON files as PNG plots beside them"),
    "make-checkpoint": Benchmark("moemesh.bench.random_checkpoint",
                                 "write a hub-format checkpoint with random weights"),
}

# modules with a `main` that are processes a benchmark starts (`python -m`), not benchmarks: module -> benchmark
WORKER_PROCESSES: dict[str, str] = {
    "moemesh.bench.cpu_mailbox_worker": "cpu-mailbox",
    "moemesh.bench.fullsize_expert": "fullsize",
    "moemesh.bench.layers_disagg": "layers-disagg",
}


def listing() -> str:
    """One line per benchmark: name and what it measures."""
    width = max(len(name) for name in BENCHMARKS)
    return "\n".join(f"{name:<{width}}  {bench.summary}" for name, bench in BENCHMARKS.items())


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--list", action="store_true", help="list the benchmarks, one line each")
    parser.add_argument("benchmark", nargs="?", metavar="NAME", help="which benchmark to run (--list names them)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def run(args: argparse.Namespace) -> int:
    if args.list or args.benchmark is None:
        print(listing())
        return 0
    bench = BENCHMARKS.get(args.benchmark)
    if bench is None:
        print(f"unknown benchmark {args.benchmark!r}; one of:\n{listing()}")
        return 2
    module = importlib.import_module(bench.module)
    return int(module.main([*bench.fixed_args, *args.bench_args]) or 0)
