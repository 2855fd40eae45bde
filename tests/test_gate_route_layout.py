"""The route layout built in the gate's launch (`gate.gate_with_layout`: the last program to finish its row block
runs `route_layout.route_layout_rows`) against the two launches it replaces (`gate.gate`, then
`route_layout.route_layout_kernel`), bit for bit: ids, weights and every layout tensor; the split-K counters
back at zero after it.

CPU: the kernels under TRITON_INTERPRET=1 at small sizes, in this process when it runs with the variable set,
else in one child pytest process that sets it; sm_90 compilation of the fused variant. CUDA: V4-Flash sizes
(skip without a GPU).
Legend: T tokens, K top-k, E routed experts, D hidden, S splits of D.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from interpret_support import INTERPRETING, cuda, interpreted, run_interpreted_tests  # noqa: E402

LAYOUT_FIELDS = ("row_token_ids", "row_slot_ids", "row_weights", "expert_offsets")


def gate_inputs(num_tokens: int, num_experts: int, hidden: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)  # [T, D]
    weight = (torch.randn(num_experts, hidden, generator=gen, device=device) / hidden ** 0.5).to(dtype)  # [E, D]
    bias = torch.randn(num_experts, generator=gen, device=device) * 0.1  # [E] fp32
    stack_table = torch.randperm(num_experts, generator=gen, device=device)  # [E] global id -> stack index
    return x, weight, bias, stack_table


def assert_fused_equals_two_launches(x, weight, bias, stack_table, top_k, config=None, **hashed) -> None:
    from moemesh.common.kernels import gate as gate_kernel
    from moemesh.common.kernels import split_k
    from moemesh.common.kernels.route_layout import route_layout_kernel

    num_experts = weight.shape[0]
    kwargs = dict(top_k=top_k, route_scale=2.5, bias=None if hashed else bias, config=config, **hashed)
    ids, weights, layout = gate_kernel.gate_with_layout(x, weight, num_held=num_experts, stack_table=stack_table,
                                                        **kwargs)
    ref_ids, ref_weights = gate_kernel.gate(x, weight, **kwargs)
    reference = route_layout_kernel(ref_ids, ref_weights, num_experts, stack_table=stack_table)
    assert torch.equal(ids, ref_ids) and torch.equal(weights.view(torch.int16 if weights.element_size() == 2
                                                                  else torch.int32),
                                                     ref_weights.view(torch.int16 if weights.element_size() == 2
                                                                      else torch.int32))
    for field in LAYOUT_FIELDS:
        ours, theirs = getattr(layout, field), getattr(reference, field)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (field, ours, theirs)
    assert not split_k._counters[x.device][:64].any(), "the tickets must leave the counters at zero"


def test_fused_layout_only_at_decode_sizes():
    from moemesh.common.kernels import gate as gate_kernel

    assert gate_kernel.fuses_layout(1, 6) and gate_kernel.fuses_layout(42, 6) and not gate_kernel.fuses_layout(43, 6)
    with pytest.raises(ValueError):
        gate_kernel.gate_with_layout(torch.zeros(43, 64), torch.zeros(16, 64), top_k=6, route_scale=1.0, num_held=16)


def test_interpreted_cases_pass_in_a_child_process():
    run_interpreted_tests(__file__, keyword="interpreted_", timeout_s=1800, stop_first=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 64])
def test_interpreted_gate_with_layout_equals_gate_then_route_layout(num_tokens, dtype):
    """The launch shapes `choose_config` picks (one row: S D splits × E blocks, tickets per row block; more rows:
    row blocks of 16), K of the tiny configs (2, 3, 4) and of V4-Flash (6, at T ≤ 42)."""
    for top_k in (2, 3, 4) + ((6,) if num_tokens * 6 <= 256 else ()):
        x, weight, bias, table = gate_inputs(num_tokens, 32, 512, dtype, seed=num_tokens * 10 + top_k)
        assert_fused_equals_two_launches(x, weight, bias, table, top_k)


@interpreted
def test_interpreted_gate_with_layout_in_other_launch_shapes_and_hash_routing():
    from moemesh.common.kernels.gate import GateConfig

    x, weight, bias, table = gate_inputs(20, 16, 256, torch.bfloat16, seed=7)
    for config in (GateConfig(1, 16, 64, num_splits=2), GateConfig(16, 16, 64), GateConfig(16, 16, 32, num_splits=4)):
        assert_fused_equals_two_launches(x, weight, bias, table, 3, config=config)
    gen = torch.Generator().manual_seed(8)
    tid2eid = torch.stack([torch.randperm(16, generator=gen)[:3] for _ in range(50)])  # [V, K]
    token_ids = torch.randint(0, 50, (20,), generator=gen)
    assert_fused_equals_two_launches(x, weight, bias, table, 3, tid2eid=tid2eid, token_ids=token_ids)
    assert_fused_equals_two_launches(x[:1], weight, bias, None, 3)  # no stack table: ids are stack indices


def _ptxas_present() -> bool:
    from moemesh.bench.kernel_sass import _tool

    return os.path.exists(_tool("ptxas"))


@pytest.mark.skipif(INTERPRETING or not _ptxas_present(), reason="compiles for sm_90 (not interpreted, ptxas)")
@pytest.mark.parametrize("num_splits,block_t", [(16, 1), (1, 16)])
def test_gate_with_layout_compiles_for_sm90_without_spills(num_splits, block_t):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moemesh.bench.kernel_sass import summarise
    from moemesh.common.kernels.gate import _gate_kernel

    pointers = dict(zip(("x_ptr", "w_ptr", "bias_ptr", "tid2eid_ptr", "token_ids_ptr", "ids_ptr", "weights_ptr",
                         "partial_ptr", "counter_ptr", "table_ptr", "offsets_ptr", "row_token_ptr", "row_slot_ptr",
                         "row_weight_ptr"),
                        ("*bf16", "*bf16", "*fp32", "*i64", "*i64", "*i64", "*bf16", "*fp32", "*i32", "*i64", "*i32",
                         "*i32", "*i32", "*fp32")))
    signature = {**pointers, "num_tokens": "i32", "hidden": "i32", "num_experts": "i32", "route_scale": "fp32",
                 "num_held": "i32"}
    constexprs = {"TOP_K": 6, "KP": 8, "EP": 256, "HASH": False, "HAS_BIAS": True, "ROUND_BF16": True,
                  "BLOCK_T": block_t, "BLOCK_E": 16 if block_t == 1 else 64, "BLOCK_D": 512 if block_t == 1 else 64,
                  "D_STEPS": 1, "NUM_E_BLOCKS": 16 if block_t == 1 else 4, "NUM_SPLITS": num_splits,
                  "USE_DOT": block_t >= 16, "PRECISION": "tf32", "LAYOUT_STEPS": 1,
                  "LAYOUT_BLOCK_R": 8 if block_t == 1 else 256, "LAYOUT_BLOCK_B": 512, "HAS_TABLE": True}
    compiled = compile(ASTSource(_gate_kernel, {**signature, **{k: "constexpr" for k in constexprs}},
                                 constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4 if block_t == 1 else 8})
    assert summarise(compiled)["stack_bytes"] == 0


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 42])
def test_cuda_gate_with_layout_equals_gate_then_route_layout_at_flash_size(num_tokens):
    x, weight, bias, table = gate_inputs(num_tokens, 256, 4096, torch.bfloat16, seed=num_tokens, device="cuda")
    assert_fused_equals_two_launches(x, weight, bias, table, 6)


def test_a_handed_over_layout_serves_only_the_ids_it_was_made_from():
    """RouteLayoutHandoff: taken once, only for the same ids and weights (memory, shape, strides); a cleared or
    different offer gives None (the holder then builds its own layout)."""
    from moemesh.common.model.moe import RouteLayoutHandoff

    handoff = RouteLayoutHandoff(4, torch.arange(4))
    ids, weights = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    layout = object()
    handoff.offer(ids, weights, layout)
    assert handoff.take(ids[:2], weights[:2]) is None  # another shape: not the same routing
    handoff.offer(ids, weights, layout)
    assert handoff.take(ids, weights) is layout
    assert handoff.take(ids, weights) is None  # once
    handoff.offer(ids, weights, layout)
    handoff.clear()
    assert handoff.take(ids, weights) is None
    handoff.offer(ids, weights, layout)
    assert handoff.take(ids.clone(), weights) is None


def test_gates_are_connected_only_where_every_expert_is_held():
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import random_model, tiny_flash_like_config

    config = tiny_flash_like_config((AttentionKind.WINDOW, AttentionKind.CSA))
    side, experts = random_model(config, "cpu")
    gates = side.gates()
    assert all(gate.layout_handoff is not None for gate in gates.values())
    experts._layers[1].holds_all = False  # a holder of part of layer 1
    experts.connect_gates(gates)
    assert gates[0].layout_handoff is not None and gates[1].layout_handoff is None


@interpreted
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_interpreted_in_process_experts_take_the_gates_layout(num_tokens, monkeypatch):
    """A layer's gate with its in-process holder connected: the experts' slot outputs equal those of a holder
    building its own layout, bit for bit, and no route-layout launch runs."""
    from triton.runtime import interpreter

    from moemesh.common.kernels.glue import INTERPRET_ON_CPU_ENV
    from moemesh.common.model.config import AttentionKind, NumericsConfig
    from moemesh.common.model.quantized import KernelBackend
    from moemesh.common.model.random_init import random_model, tiny_flash_like_config

    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")
    config = tiny_flash_like_config((AttentionKind.WINDOW,), kernel_friendly=True)
    side, experts = random_model(config, "cpu", numerics=NumericsConfig(dtype="bfloat16"),
                                 backend=KernelBackend.KERNEL)
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, config.hidden_size, generator=generator).bfloat16()
    token_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=generator)
    launched, original = [], interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    ids, weights = side.gate(0, x, token_ids)
    fused = experts.per_expert_outputs(0, x, ids, weights)
    assert "_route_layout_kernel" not in launched, launched
    side.layers[0].ffn.gate.layout_handoff.clear()  # the holder builds its own layout
    own = experts.per_expert_outputs(0, x, ids, weights)
    assert "_route_layout_kernel" in launched
    assert torch.equal(fused, own)
