"""The GPU-only kernel variants compile for sm_90 on a machine without a GPU (Triton ships ptxas).

The interpreter cannot run inline PTX or `tl.dot_scaled`, so without this a typo in those paths
would first show up on the device; here they go through the whole Triton + ptxas pipeline.
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from moemesh.bench.kernel_sass import _tool, compile_grouped, summarise  # noqa: E402
from moemesh.common.kernels.expert_configs import Fp4Decode, GroupedGemmConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists(_tool("ptxas")), reason="triton without its bundled ptxas")

VARIANTS = [  # the default decode (ASM_QUAD, split-K gate-up) and its word-scale sibling
    ("asm_quad_gate_up_split2", GroupedGemmConfig(16, 64, 128, 4, 3, 2, Fp4Decode.ASM_QUAD), True),
    ("asm_quad_word_scales_down", GroupedGemmConfig(16, 64, 128, 4, 3, 1, Fp4Decode.ASM_QUAD_WORD_SCALES), False),
]


def test_fp8_weights_asm_quad_compiles_for_sm90():
    summary = summarise(compile_grouped(GroupedGemmConfig(16, 64, 128, 4, 3, 2, Fp4Decode.ASM_QUAD),
                                        fused_gate_up=True, weight_format=1))
    assert summary["stack_bytes"] == 0, summary
    assert summary["opcodes"].get("HMUL2", 0) > 0 and summary["opcodes"].get("HGMMA", 0) > 0, summary


@pytest.mark.parametrize("config,fused", [(c, f) for _, c, f in VARIANTS], ids=[name for name, _, _ in VARIANTS])
def test_gpu_only_variant_compiles_for_sm90_without_spills(config, fused):
    summary = summarise(compile_grouped(config, fused_gate_up=fused))
    assert summary["num_instructions"] > 100
    assert summary["stack_bytes"] == 0, summary
    assert summary["opcodes"].get("HMUL2", 0) > 0, "the inline PTX decode is not in the binary"
    assert summary["opcodes"].get("HGMMA", 0) > 0, "no Hopper wgmma in the main loop"


def test_dependent_launch_waits_before_its_first_load():
    """As a programmatic dependent the kernel waits on the previous grid before any global load."""
    config = GroupedGemmConfig(16, 64, 128, 4, 3, 2, Fp4Decode.ASM_QUAD)
    ptx = compile_grouped(config, fused_gate_up=True, dependent=True).asm["ptx"]
    plain = compile_grouped(config, fused_gate_up=True).asm["ptx"]
    assert "griddepcontrol" not in plain
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("griddepcontrol.launch_dependents")
    assert wait < ptx.index("ld.global"), "a global load ahead of the wait"
