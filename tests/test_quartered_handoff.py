"""The k-quartered handoff between the grouped gate-up and down launches (`fp4_experts.quartered_handoff`).

Gate-up may write its SwiGLU rows k-quartered (within each 128-column block, column 4j + r at r·32 + j)
for a down launch that then loads x's four k-mod-4 quarters as contiguous tiles. Checked here: the
layout against its torch reference (`quarter_columns`) under the interpreter, when the handoff is
chosen, and that the quartered down launch compiles for sm_90 without staging x through registers; on a
GPU, that the handoff leaves every result bit unchanged at decode and short-prefill sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

REPO_ROOT = Path(__file__).resolve().parent.parent

_INTERPRETED = r"""
import json, torch
from moemesh.bench.checks.quantized_kernels import random_fp4_weight
from moemesh.common.kernels.expert_configs import Fp4Decode, GroupedGemmConfig
from moemesh.common.kernels.expert_rows import quarter_columns
from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat, grouped_gate_up
from moemesh.common.kernels.moe_layout import sort_by_expert

g = torch.Generator().manual_seed(3)
experts, hidden, width, tokens, top_k = 4, 64, 256, 3, 2
w1, s1 = random_fp4_weight((experts, width, hidden), g, "cpu")
w3, s3 = random_fp4_weight((experts, width, hidden), g, "cpu")
w2, s2 = random_fp4_weight((experts, hidden, width), g, "cpu")
weights = ExpertWeights(w1, s1, w3, s3, w2, s2, WeightFormat.FP4_E2M1)
layout = sort_by_expert(torch.randint(0, experts, (tokens, top_k), generator=g), experts)
x = torch.randn(tokens * top_k, hidden, generator=g) * 0.1
config = GroupedGemmConfig(16, 64, 32, 4, 1, 1, Fp4Decode.HALVES)
plain = grouped_gate_up(x, layout.expert_offsets, weights, swiglu_limit=7.0, config=config)
quartered = grouped_gate_up(x, layout.expert_offsets, weights, swiglu_limit=7.0, config=config, quartered_out=True)
print(json.dumps({"equal": bool(torch.equal(quartered, quarter_columns(plain))),
                  "moved": bool(not torch.equal(quartered, plain))}))
"""


def test_quartered_output_is_the_reference_layout_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"equal": True, "moved": True}


def test_quarter_columns_moves_column_4j_plus_r_to_r_times_32_plus_j():
    from moemesh.common.kernels.expert_rows import quarter_columns

    row = torch.arange(256.0)[None, :]  # [1, C]: each entry is its own column index
    quartered = quarter_columns(row)[0]
    for col in (0, 1, 2, 3, 4, 5, 127, 128, 129, 255):
        block, within = divmod(col, 128)
        assert quartered[block * 128 + (within % 4) * 32 + within // 4] == col


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the GPU decode is chosen only when compiled")
def test_handoff_is_chosen_where_down_decodes_with_asm_quad_at_128_wide_steps():
    from moemesh.bench.checks.quantized_kernels import random_fp4_weight
    from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat, quartered_handoff

    g = torch.Generator().manual_seed(0)
    parts = [random_fp4_weight(shape, g, "cpu") for shape in ((256, 2048, 4096), (256, 2048, 4096), (256, 4096, 2048))]
    weights = ExpertWeights(*parts[0], *parts[1], *parts[2], WeightFormat.FP4_E2M1)
    cpu = torch.device("cpu")
    assert quartered_handoff(6, weights, torch.bfloat16, cpu)  # one token: ASM_QUAD, 128-wide K steps
    assert quartered_handoff(64 * 6, weights, torch.bfloat16, cpu)
    assert not quartered_handoff(8192 * 6, weights, torch.bfloat16, cpu)  # prefill tiles step 64 columns
    assert not quartered_handoff(6, weights, torch.float32, cpu)  # the portable decode


def test_quartered_down_compiles_for_sm90_with_x_loaded_straight_to_shared_memory():
    from moemesh.bench.kernel_sass import _tool, compile_grouped, summarise
    from moemesh.common.kernels.expert_configs import Fp4Decode, GroupedGemmConfig

    if not os.path.exists(_tool("ptxas")):
        pytest.skip("triton without its bundled ptxas")
    config = GroupedGemmConfig(16, 64, 128, 4, 3, 1, Fp4Decode.ASM_QUAD)
    plain = summarise(compile_grouped(config, fused_gate_up=False))
    quartered = summarise(compile_grouped(config, fused_gate_up=False, x_quartered=True))
    assert quartered["stack_bytes"] == 0 and quartered["opcodes"].get("HGMMA", 0) > 0, quartered
    assert plain["opcodes"].get("STSM", 0) > 0, "the plain launch splits x in registers and stores it for the dots"
    assert quartered["opcodes"].get("STSM", 0) == 0, "the quartered launch should load x's quarters directly"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 300])
def test_handoff_leaves_every_bit_unchanged_on_the_gpu(num_tokens):
    from moemesh.bench.checks.quantized_kernels import random_fp4_weight
    from moemesh.common.kernels.expert_rows import quarter_columns
    from moemesh.common.kernels.fp4_experts import (
        ExpertWeights, WeightFormat, grouped_down, grouped_experts, grouped_gate_up, quartered_handoff,
    )
    from moemesh.common.kernels.moe_layout import sort_by_expert

    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    parts = [random_fp4_weight(shape, g, "cuda") for shape in ((256, 2048, 4096), (256, 2048, 4096), (256, 4096, 2048))]
    weights = ExpertWeights(*parts[0], *parts[1], *parts[2], WeightFormat.FP4_E2M1)
    ids = torch.rand(num_tokens, 256, device="cuda", generator=g).topk(6, dim=1).indices
    layout = sort_by_expert(ids, 256)
    x = torch.randn(num_tokens * 6, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    row_weights = torch.rand(num_tokens * 6, device="cuda", generator=g)
    assert quartered_handoff(x.shape[0], weights, x.dtype, x.device)
    h = grouped_gate_up(x, layout.expert_offsets, weights, swiglu_limit=10.0)
    h_quartered = grouped_gate_up(x, layout.expert_offsets, weights, swiglu_limit=10.0, quartered_out=True)
    assert torch.equal(h_quartered, quarter_columns(h))
    plain = grouped_down(h, layout.expert_offsets, weights, row_weights=row_weights)
    handed = grouped_down(h_quartered, layout.expert_offsets, weights, row_weights=row_weights, hidden_quartered=True)
    assert torch.equal(handed, plain)
    assert torch.equal(grouped_experts(x, layout.expert_offsets, weights, swiglu_limit=10.0, row_weights=row_weights),
                       plain)
