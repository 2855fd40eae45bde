"""Which implementation runs the per-layer glue (mHC, RMS norms, RoPE, MoE gate): Triton on CUDA, torch elsewhere.

The torch code in `common/model/{hyper,linear,rope,moe}.py` is the CPU path and the fp32 oracle; the
Triton kernels in `common/kernels/{mhc,norm_rope,gate}.py` replace it on CUDA tensors because the torch
version launches hundreds of 1–2 µs kernels per layer (docs/performance.md, "Where the time goes").

Rules (read on every call, so a test or a benchmark may flip the switch between calls):
- `MOEMESH_TORCH_GLUE=1` forces the torch path on CUDA too (comparisons, bisecting a wrong result);
- autograd (grad enabled and some input requiring grad) takes the torch path: the kernels have no
  backward;
- code traced by torch.compile takes the torch path: the compiler fuses those operators itself, and the
  launchers of these kernels are not traceable;
- no triton installed -> torch path.
Importing this module imports neither torch nor triton.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

TORCH_GLUE_ENV = "MOEMESH_TORCH_GLUE"
# Test hook: with TRITON_INTERPRET=1 as well, CPU tensors take the Triton path too (the interpreter
# runs it), so a whole model forward on CPU exercises every dispatch site against the oracle.
INTERPRET_ON_CPU_ENV = "MOEMESH_TRITON_GLUE_ON_CPU"


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def torch_glue_forced() -> bool:
    return os.environ.get(TORCH_GLUE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _interpret_on_cpu() -> bool:
    return os.environ.get(INTERPRET_ON_CPU_ENV) == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton_glue(*tensors) -> bool:
    """True when every tensor is on CUDA and nothing asks for the torch path (see module doc)."""
    import torch

    if not all(t.is_cuda for t in tensors) and not _interpret_on_cpu():
        return False
    if torch_glue_forced() or not triton_installed():
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if torch.compiler.is_compiling():
        return False
    return True


@contextlib.contextmanager
def forced_torch_glue(forced: bool = True):
    """Within the block, the glue takes the torch path (forced) or the default rule (not forced).

    Sets the process environment: meant for benchmarks and tests, not for serving threads.
    """
    previous = os.environ.get(TORCH_GLUE_ENV)
    os.environ[TORCH_GLUE_ENV] = "1" if forced else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(TORCH_GLUE_ENV, None)
        else:
            os.environ[TORCH_GLUE_ENV] = previous
