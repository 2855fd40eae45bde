"""The GPU-only kernel variants compile for sm_90 on a machine without a GPU (Triton ships ptxas); as dependent
launches the decode kernels wait before their first load and the weight-streaming ones prefetch ahead of the wait.

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


def test_fp4_quad_decode_places_codes_without_byte_permutes():
    """The quad decode shifts each output straight out of the loaded word: per decoded word (4 HMUL2) one PRMT for
    the scale pair, none for the codes, so the fused gate-up launch has fewer PRMT than half its HMUL2."""
    summary = summarise(compile_grouped(GroupedGemmConfig(16, 64, 128, 4, 3, 2, Fp4Decode.ASM_QUAD),
                                        fused_gate_up=True))
    opcodes = summary["opcodes"]
    assert opcodes.get("PRMT", 0) < opcodes["HMUL2"] // 2, opcodes


def test_dependent_launch_waits_before_its_first_load():
    """As a programmatic dependent the kernel waits on the previous grid before any global load."""
    config = GroupedGemmConfig(16, 64, 128, 4, 3, 2, Fp4Decode.ASM_QUAD)
    ptx = compile_grouped(config, fused_gate_up=True, dependent=True).asm["ptx"]
    plain = compile_grouped(config, fused_gate_up=True).asm["ptx"]
    assert "griddepcontrol" not in plain
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("griddepcontrol.launch_dependents")
    assert wait < ptx.index("ld.global"), "a global load ahead of the wait"


def test_wait_only_dependent_launch_never_signals_early():
    from moemesh.common.kernels.dependent_launch import WAIT_ONLY

    config = GroupedGemmConfig(16, 64, 128, 4, 3, 2, Fp4Decode.ASM_QUAD)
    ptx = compile_grouped(config, fused_gate_up=True, dependent=WAIT_ONLY).asm["ptx"]
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert "griddepcontrol.launch_dependents" not in ptx


def _compile_dependent(kernel, constexprs: dict, pointer_types: dict, floats: tuple = ()):
    """`kernel` compiled for sm_90 as a dependent launch; pointers default to bf16, scalars to int32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in floats else "i32"
    source = ASTSource(kernel, signature, constexprs={**constexprs, "USE_PDL": True, "PREFETCH_L2": True})
    return compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True})


def _weight_prefetch_cases():
    from moemesh.common.kernels.fp8_linear import _fp8_linear_kernel
    from moemesh.common.kernels.gate import _gate_kernel
    from moemesh.common.kernels.projections import _projections_kernel

    u8, f32, i32 = "*u8", "*fp32", "*i32"
    fp8 = {"x_ptr": "*bf16", "w_ptr": u8, "s_ptr": u8, "w_up_ptr": u8, "s_up_ptr": u8, "partial_ptr": f32,
           "counter_ptr": i32}
    fp8_constexprs = dict(SPLIT_K=2, K_STEPS_PER_SPLIT=4, USE_FMA=False, ASM_DECODE=True, ASM_QUAD=True,
                          GATE_UP=True, HAS_LIMIT=True, BLOCK_N=64, BLOCK_T=16, BLOCK_K=128, QUANT_BLOCK=128,
                          norm_weight_ptr=None, cos_ptr=None, sin_ptr=None, rope_half=0, norm_eps=0.0, NORM_GROUP=0,
                          NORM=0, ROPE=False, ROPE_BLOCK=1)
    gate_constexprs = dict(TOP_K=6, KP=8, EP=256, HASH=False, HAS_BIAS=True, ROUND_BF16=True, BLOCK_T=16, BLOCK_E=64,
                           BLOCK_D=128, D_STEPS=8, NUM_E_BLOCKS=4, NUM_SPLITS=4, USE_DOT=False, PRECISION="tf32",
                           table_ptr=None, offsets_ptr=None, row_token_ptr=None, row_slot_ptr=None,
                           row_weight_ptr=None, num_held=0, LAYOUT_STEPS=0, LAYOUT_BLOCK_R=1, LAYOUT_BLOCK_B=1,
                           HAS_TABLE=False)
    gate_pointers = {"bias_ptr": f32, "tid2eid_ptr": i32, "token_ids_ptr": i32, "ids_ptr": i32, "weights_ptr": f32,
                     "partial_ptr": f32, "counter_ptr": i32}
    projection_constexprs = dict(RATIO=4, WIDTH_TILES=4, WIDTH2_TILES=2, SPLIT_K=2, K_STEPS_PER_SPLIT=8, BLOCK_N=64,
                                 BLOCK_T=16, BLOCK_K=128)
    projection_pointers = {name: f32 for name in ("kv_ptr", "score_ptr", "kv2_ptr", "score2_ptr", "head_ptr",
                                                   "ape_ptr", "ape2_ptr", "partial_ptr")}
    projection_pointers.update(positions_ptr=i32, counter_ptr=i32)
    return [("fp8_linear", _fp8_linear_kernel, fp8_constexprs, fp8, ("swiglu_limit",)),
            ("gate", _gate_kernel, gate_constexprs, gate_pointers, ("route_scale",)),
            ("projections", _projections_kernel, projection_constexprs, projection_pointers, ("head_scale",))]


@pytest.mark.parametrize("case", _weight_prefetch_cases(), ids=lambda case: case[0])
def test_weight_prefetch_goes_ahead_of_the_wait(case):
    """The weight-streaming kernels bulk-prefetch their weight rows into L2, then wait, then load."""
    _, kernel, constexprs, pointers, floats = case
    ptx = _compile_dependent(kernel, constexprs, pointers, floats).asm["ptx"]
    prefetch, wait = ptx.index("cp.async.bulk.prefetch.L2.global"), ptx.index("griddepcontrol.wait")
    assert prefetch < wait < ptx.index("ld.global")
    assert wait < ptx.index("griddepcontrol.launch_dependents")
