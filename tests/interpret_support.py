"""Triton kernels on the CPU in the test suite: the markers, the interpreter patches, and the one child process
that runs a file's interpreted tests when pytest itself does not interpret.

A file imports `INTERPRETING`, `interpreted`, `cuda` and calls `patch_interpreter()` at import; its
`test_interpreted_cases_in_a_child` calls `run_interpreted_tests(__file__)`, which sets TRITON_INTERPRET=1 for
one pytest child over the file's `-k interpreted` tests (Triton reads the variable at import, so the parent
process cannot switch to it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs the kernels under TRITON_INTERPRET=1 "
                                 "(test_interpreted_cases_in_a_child runs them)")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING, reason="needs a CUDA device, compiled kernels")


def patch_interpreter() -> None:
    """The interpreter's bf16 dots and scalar loop bounds as the GPU has them (a no-op when not interpreting)."""
    if not INTERPRETING:
        return
    from moemesh.bench.checks.attention import patch_interpreter_scalar_index
    from moemesh.bench.checks.quantized_kernels import patch_interpreter_bf16_dot

    patch_interpreter_bf16_dot()
    patch_interpreter_scalar_index()


def run_interpreted_tests(test_file: str, keyword: str = "interpreted", timeout_s: int = 900,
                          stop_first: bool = False) -> None:
    """Run `test_file`'s tests matching `keyword` in one child pytest under TRITON_INTERPRET=1; they must pass."""
    if INTERPRETING:
        pytest.skip("this process interprets: the cases run here")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", *(["-x"] if stop_first else []), "-p", "no:cacheprovider",
               "-p", "no:xdist", "-o", "addopts=", "-k", keyword, str(Path(test_file).resolve())]
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]
