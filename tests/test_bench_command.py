"""`moemesh bench`: every benchmark entry point under bench/ has a name, every name reaches a `main`."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from moemesh.commands.bench import BENCHMARKS, WORKER_PROCESSES

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def _modules_with_main() -> set[str]:
    """`moemesh.bench.<name>` of every bench/*.py that defines a top-level `main`."""
    found = set()
    for path in sorted(BENCH_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            found.add(f"moemesh.bench.{path.stem}")
    return found


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_imports_and_has_main(name):
    module = importlib.import_module(BENCHMARKS[name].module)
    assert callable(getattr(module, "main", None)), f"{name}: {module.__name__} has no main"


def test_every_bench_module_with_main_is_named():
    named = {bench.module for bench in BENCHMARKS.values()} | set(WORKER_PROCESSES)
    missing = _modules_with_main() - named
    assert not missing, f"bench modules with a main but no name in BENCHMARKS: {sorted(missing)}"
    stale = named - _modules_with_main()
    assert not stale, f"names for modules without a main: {sorted(stale)}"


@pytest.mark.parametrize("module", sorted(WORKER_PROCESSES))
def test_worker_processes_are_started_by_their_benchmark(module):
    """A worker process's module is named in the source of the benchmark it belongs to (or its helpers)."""
    benchmark_module = BENCHMARKS[WORKER_PROCESSES[module]].module
    stem = benchmark_module.rsplit(".", 1)[1]
    sources = "".join(p.read_text(encoding="utf-8") for p in BENCH_DIR.glob(f"{stem}*.py")
                      if f"moemesh.bench.{p.stem}" != module)
    assert module in sources or module.rsplit(".", 1)[1] in sources


def test_list_prints_every_benchmark_once(capsys):
    from moemesh.cli import main

    assert main(["bench", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(BENCHMARKS)
    assert main(["bench"]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_unknown_benchmark_is_refused(capsys):
    from moemesh.cli import main

    assert main(["bench", "no-such-benchmark"]) == 2
    assert "unknown benchmark" in capsys.readouterr().out


def test_fixed_arguments_come_first(monkeypatch):
    from moemesh.bench import layers
    from moemesh.cli import main

    seen = []
    monkeypatch.setattr(layers, "main", lambda argv: seen.append(argv) or 0)
    assert main(["bench", "layers-disagg", "--batch", "1"]) == 0
    assert seen == [["--disaggregated", "--batch", "1"]]
