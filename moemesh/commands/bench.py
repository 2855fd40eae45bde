"""`moemesh bench NAME [args...]`: runs one benchmark module from `bench/`.

`moemesh bench make-checkpoint ... --out DIR` writes a hub-format checkpoint with random weights
(bench.random_checkpoint), the model every benchmark loads from disk.

Each benchmark module defines `main(argv: list[str] | None) -> int`, prints its figures and writes
JSON under bench/results/ (bench.results_io).
"""

from __future__ import annotations

import argparse
import importlib

# benchmark name -> module under the bench package
BENCHMARKS: dict[str, str] = {
    "dispatch": "moemesh.bench.dispatch",
    "scheduler": "moemesh.bench.scheduler_cost",
    "kernels": "moemesh.bench.kernels",
    "layers": "moemesh.bench.layers",
    "fullsize": "moemesh.bench.fullsize",
    "serve": "moemesh.bench.serve",
    "speculation": "moemesh.bench.speculation",
    "make-checkpoint": "moemesh.bench.random_checkpoint",
}


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), help="which benchmark to run")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def run(args: argparse.Namespace) -> int:
    module_name = BENCHMARKS[args.benchmark]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            print(f"benchmark {args.benchmark!r} is not built yet ({module_name} is missing)")
            return 2
        raise
    return int(module.main(list(args.bench_args)) or 0)
