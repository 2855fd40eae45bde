"""`bench.layers`' prefill timing runs the batched attention kernels, not the per-sequence torch loop.

States made inside `torch.inference_mode()` would put the layer benchmark's prefill on the torch path:
the kernels' address tables find a preallocated row store through a view's `_base`, which inference
tensors lack, so the tables come back None. A child process
runs `time_prefill` under TRITON_INTERPRET=1 with the Triton attention backend forced on the CPU and
reports which path the forward took."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO_ROOT = Path(__file__).resolve().parents[1]


def test_prefill_timing_takes_the_kernel_attention_path():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "attention_path=kernels"


if __name__ == "__main__":  # the interpreted child
    import torch

    from moemesh.bench.checks.attention import patch_interpreter_scalar_index
    from moemesh.bench.checks.quantized_kernels import patch_interpreter_bf16_dot

    patch_interpreter_bf16_dot()
    patch_interpreter_scalar_index()
    import moemesh.common.model.batch as batch_module

    batch_module.default_attention_backend = lambda device: batch_module.AttentionBackend.TRITON  # CPU: kernels
    from moemesh.bench import layers_timing as timing
    from moemesh.common.model.config import AttentionKind, NumericsConfig
    from moemesh.common.model.random_init import random_model, tiny_flash_like_config

    torch.set_num_threads(1)
    config = tiny_flash_like_config([AttentionKind.CSA, AttentionKind.HCA], kernel_friendly=True)
    side, experts = random_model(config, "cpu", numerics=NumericsConfig(dtype="bfloat16"))
    timed = timing.time_prefill(side, experts, config, 40, num_reps=1)
    print(f"attention_path={timed.attention_path}")
