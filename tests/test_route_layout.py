"""The one-launch route layout and in-order slot sum (common/kernels/route_layout.py), the grouped
kernels' row indices (`fp4_experts.grouped_gate_up` x_row_ids, `grouped_down` out_row_ids), and
`QuantizedRoutedExperts`' kernel path built on them: against their torch references, and bit for bit
against the composition they replace (stable torch.sort layout, gather of x, gather of the route
weights, `_unsort_rows`, the slot-mask multiply, the torch slot sum).

CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes, in this process when it runs with
the variable set, else in one child pytest process that sets it (the interpreter is chosen when a
kernel is decorated); the number of launches of the kernel path, counted under the interpreter; sm_90
compilation of the new kernel variants (Triton's bundled ptxas). CUDA at V4-Flash sizes:
tests/test_route_layout_cuda.py.
Legend: T tokens, K top-k, R = T·K rows, E held experts, D hidden, I expert width.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from moemesh.common.kernels.expert_configs import Fp4Decode, GroupedGemmConfig  # noqa: E402
from moemesh.common.kernels.fp4_experts import grouped_down, grouped_gate_up  # noqa: E402
from moemesh.common.kernels.moe_layout import sum_slots_in_order_torch  # noqa: E402
from moemesh.common.kernels.route_layout import (RouteLayout, route_layout, route_layout_kernel,  # noqa: E402
                                                 route_layout_torch, sum_slots_kernel)
from moemesh.common.model.quantized import KernelBackend  # noqa: E402
from moemesh.common.model.quantized_experts import (ExpertFormat, QuantizedRoutedExperts,  # noqa: E402
                                                    _unsort_rows, layout_by_expert)
from moemesh.common.model.random_init import random_fp4_stack, random_fp8_stack  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="Triton on the CPU needs TRITON_INTERPRET=1 "
                                 "(test_interpreted_cases_pass_in_a_child_process runs them so)")
NUM_ROUTED, HELD_IDS, HIDDEN, INTER, TOP_K, LIMIT = 10, [0, 2, 3, 5, 6, 9], 256, 128, 3, 10.0
LAYOUT_FIELDS = ("row_token_ids", "row_slot_ids", "row_weights", "expert_offsets")


# ------------------------------------------------------------------------------ shared references
def replaced_rows(holder: QuantizedRoutedExperts, layer: int, hidden: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, slot_mask: torch.Tensor | None) -> torch.Tensor:
    """The composition the kernel path replaces, on the same grouped kernels -> [T, K, D]: every slot
    computed (stack index through the held table), rows sorted by torch.sort, gathered, unsorted by
    `_unsort_rows`, then the mask multiplied in."""
    held = holder._layers[layer]
    layout = layout_by_expert(held.local[ids], len(held.expert_ids))
    stacked = held.kernel_weights()
    x_sorted = hidden[layout.row_token_ids]  # [R, D]
    row_weights = weights.reshape(-1)[layout.row_slot_ids].float()  # [R]
    h = grouped_gate_up(x_sorted, layout.expert_offsets, stacked, swiglu_limit=holder.swiglu_limit)  # [R, I]
    if holder.route_weight_before_w2:
        h = (h.float() * row_weights[:, None]).to(hidden.dtype)
        y = grouped_down(h, layout.expert_offsets, stacked)
    else:
        y = grouped_down(h, layout.expert_offsets, stacked, row_weights=row_weights)  # [R, D]
    out = _unsort_rows(y, layout.row_slot_ids).view(*ids.shape, -1)  # [T, K, D]
    if slot_mask is not None:
        out = out * slot_mask[..., None].to(out.dtype)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (bitwise comparison, NaN and signed zeros included)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_as_replaced(out: torch.Tensor, expected: torch.Tensor, slot_mask: torch.Tensor | None) -> None:
    """Selected slots bit for bit; masked slots +0 in `out` (`expected`'s mask multiply may give -0 or NaN)."""
    selected = torch.ones(out.shape[:2], dtype=torch.bool, device=out.device) if slot_mask is None else slot_mask
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.equal(bits(out[selected]), bits(expected[selected]))
    assert not bits(out[~selected]).any()


def assert_same_layout(ours: RouteLayout, theirs: RouteLayout) -> None:
    for field in LAYOUT_FIELDS:
        a, b = getattr(ours, field), getattr(theirs, field)
        assert a.dtype == b.dtype and torch.equal(a, b), (field, a, b)


def random_holder(fmt: ExpertFormat = ExpertFormat.FP4, *, held_ids=HELD_IDS, num_routed=NUM_ROUTED,
                  hidden=HIDDEN, inter=INTER, before_w2: bool = False, device="cpu",
                  seed: int = 0) -> QuantizedRoutedExperts:
    gen = torch.Generator(device=device).manual_seed(seed)
    make = random_fp4_stack if fmt is ExpertFormat.FP4 else random_fp8_stack
    num_held = len(held_ids)
    w1, s1 = make(num_held, inter, hidden, generator=gen, device=device)
    w2, s2 = make(num_held, hidden, inter, generator=gen, device=device)
    w3, s3 = make(num_held, inter, hidden, generator=gen, device=device)
    return QuantizedRoutedExperts({0: (list(held_ids), (w1, s1, w2, s2, w3, s3))}, num_routed, LIMIT,
                                  expert_format=fmt, route_weight_before_w2=before_w2, backend=KernelBackend.KERNEL)


def random_routing(num_tokens: int, *, num_routed=NUM_ROUTED, top_k=TOP_K, hidden=HIDDEN, dtype=torch.bfloat16,
                   device="cpu", seed: int = 1):
    """hidden [T, D] (large enough that the SwiGLU clamps act), ids [T, K] distinct per token, weights [T, K]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(num_tokens, num_routed, generator=gen, device=device).argsort(-1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.1
    x = torch.randn(num_tokens, hidden, generator=gen, device=device) * 3
    return x.to(dtype), ids, weights


# ------------------------------------------------------------------------------ torch only
def test_torch_layout_without_mask_is_the_stable_sort_layout():
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 16, (37, 6), generator=gen)
    weights = torch.rand(37, 6, generator=gen)
    ours, theirs = route_layout_torch(ids, weights, 16), layout_by_expert(ids, 16)
    assert torch.equal(ours.expert_offsets, theirs.expert_offsets)
    assert torch.equal(ours.row_slot_ids.long(), theirs.row_slot_ids)
    assert torch.equal(ours.row_token_ids.long(), theirs.row_token_ids)
    assert torch.equal(ours.row_weights, weights.reshape(-1)[theirs.row_slot_ids])


def test_torch_layout_with_mask_keeps_the_selected_rows_in_order_then_the_masked_slots():
    gen = torch.Generator().manual_seed(10)
    table = torch.tensor([3, 0, 0, 1, 0, 2, 0, 4])  # global id -> stack index (5 held)
    ids = torch.randint(0, 8, (23, 4), generator=gen)
    mask = torch.rand(23, 4, generator=gen) < 0.5
    weights = torch.rand(23, 4, generator=gen)
    ours = route_layout_torch(ids, weights, 5, stack_table=table, slot_mask=mask)
    everything = layout_by_expert(table[ids], 5)
    selected_rows = everything.row_slot_ids[mask.reshape(-1)[everything.row_slot_ids]]
    num_selected = int(mask.sum())
    assert ours.expert_offsets[-1] == num_selected
    assert torch.equal(ours.row_slot_ids[:num_selected].long(), selected_rows)  # same rows, same order
    assert torch.equal(ours.row_slot_ids[num_selected:].long(), torch.nonzero(~mask.reshape(-1)).squeeze(1))
    counts = torch.bincount(table[ids][mask], minlength=5)
    assert torch.equal(ours.expert_offsets.diff().long(), counts)


# ------------------------------------------------------------------------------ interpreter
@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreter run")
def test_interpreted_cases_pass_in_a_child_process():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-o", "addopts=", __file__], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@interpreted
@pytest.mark.parametrize("num_tokens,top_k,num_experts,with_table,with_mask", [
    (1, 6, 8, False, False), (1, 6, 256, True, True), (37, 3, 6, True, True), (60, 6, 16, False, True),
    (100, 6, 256, True, True), (4, 2, 5, True, False)])  # 100 x 6 = 600 rows: three steps of 256
def test_layout_kernel_equals_torch_layout(num_tokens, top_k, num_experts, with_table, with_mask):
    gen = torch.Generator().manual_seed(num_tokens)
    num_routed = num_experts + 4 if with_table else num_experts
    ids = torch.randint(0, num_routed, (num_tokens, top_k), generator=gen)
    table = torch.randint(0, num_experts, (num_routed,), generator=gen) if with_table else None
    mask = torch.rand(num_tokens, top_k, generator=gen) < 0.6 if with_mask else None
    weights = torch.rand(num_tokens, top_k, generator=gen).to(torch.bfloat16)
    ours = route_layout_kernel(ids, weights, num_experts, stack_table=table, slot_mask=mask)
    assert_same_layout(ours, route_layout_torch(ids, weights, num_experts, stack_table=table, slot_mask=mask))


@interpreted
def test_layout_kernel_takes_strided_int32_ids_and_any_mask():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 7, (5, 9), generator=gen, dtype=torch.int32).t()  # [9, 5] strided
    weights = torch.rand(5, 9, generator=gen, dtype=torch.float64).t()
    for mask in (torch.zeros(9, 5, dtype=torch.bool), torch.ones(9, 5, dtype=torch.bool),
                 torch.rand(5, 9, generator=gen).t() < 0.3):
        assert_same_layout(route_layout_kernel(ids, weights, 7, slot_mask=mask),
                           route_layout_torch(ids, weights, 7, slot_mask=mask))
    empty = route_layout_kernel(ids[:0], weights[:0], 7)
    assert empty.row_slot_ids.numel() == 0 and not empty.expert_offsets.any()
    assert_same_layout(route_layout(ids, weights, 7), route_layout_torch(ids, weights, 7))


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_slot_sum_kernel_is_bit_identical_to_torch(dtype):
    gen = torch.Generator().manual_seed(5)
    for shape in ((3, 6, 700), (2, 1, 5), (1, 4, 1024)):
        slots = (torch.randn(shape, generator=gen) * torch.logspace(-4, 4, shape[-1])).to(dtype)  # [T, K, D]
        slots[0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")]).to(dtype)
        slots[-1, :, -1] = torch.tensor([-0.0] * shape[1]).to(dtype)  # -0 + -0 stays -0
        ours, reference = sum_slots_kernel(slots), sum_slots_in_order_torch(slots)
        assert ours.shape == reference.shape and ours.dtype == dtype
        assert torch.equal(bits(ours.nan_to_num()), bits(reference.nan_to_num()))
        assert torch.equal(ours.isnan(), reference.isnan())


@interpreted
@pytest.mark.parametrize("config", [
    None,  # the default for the rows: HALVES, 16-row tiles, split-K 2 here
    GroupedGemmConfig(1, 32, 64, 4, 2, 1, Fp4Decode.FMA),
    GroupedGemmConfig(16, 64, 128, 4, 2, 1, Fp4Decode.JOIN),
], ids=["default", "fma_m1", "join_m16"])
def test_grouped_kernels_with_row_ids_equal_gathered_rows(config):
    holder = random_holder()
    held = holder._layers[0]
    stacked = held.kernel_weights()
    hidden, ids, weights = random_routing(4, dtype=torch.float32)
    mask = holder.held_mask(0, ids) & (torch.arange(TOP_K) != 1)  # slot 1 masked everywhere
    layout = route_layout_torch(ids, weights, len(HELD_IDS), stack_table=held.local, slot_mask=mask)
    num_rows, num_selected = ids.numel(), int(mask.sum())
    h = grouped_gate_up(hidden, layout.expert_offsets, stacked, swiglu_limit=LIMIT, config=config,
                        x_row_ids=layout.row_token_ids)  # [R, I]
    gathered = grouped_gate_up(hidden[layout.row_token_ids.long()], layout.expert_offsets, stacked,
                               swiglu_limit=LIMIT, config=config)
    assert h.shape == (num_rows, INTER)
    assert torch.equal(bits(h[:num_selected]), bits(gathered[:num_selected]))
    h[num_selected:] = float("nan")  # rows without an expert are never read
    y = grouped_down(h, layout.expert_offsets, stacked, row_weights=layout.row_weights, config=config,
                     out_row_ids=layout.row_slot_ids)  # [R, D] slot order
    sorted_rows = grouped_down(h, layout.expert_offsets, stacked, row_weights=layout.row_weights, config=config)
    slots = layout.row_slot_ids.long()
    assert torch.equal(bits(y[slots[:num_selected]]), bits(sorted_rows[:num_selected]))
    assert not bits(y[slots[num_selected:]]).any()  # masked slots: +0 exactly


@interpreted
@pytest.mark.parametrize("fmt,dtype,before_w2,masked", [
    (ExpertFormat.FP4, torch.float32, False, False),
    (ExpertFormat.FP4, torch.float32, False, True),
    (ExpertFormat.FP4, torch.float32, True, True),
    (ExpertFormat.FP8, torch.float32, False, True),
    (ExpertFormat.FP4, torch.bfloat16, False, True),
    (ExpertFormat.FP8, torch.bfloat16, True, False),
])
def test_kernel_path_is_bit_identical_to_the_replaced_composition(fmt, dtype, before_w2, masked):
    """Bit for bit against the replaced composition; fp32 also against the torch path. (The interpreter's
    dot of bf16 tiles is not the GPU's: bf16 activations check the plumbing here, their values on CUDA.)"""
    holder = random_holder(fmt, before_w2=before_w2, seed=2)
    hidden, ids, weights = random_routing(5, dtype=dtype, seed=3)
    mask = holder.held_mask(0, ids) if masked else None
    if not masked:  # every slot must name a held expert
        ids = torch.tensor(HELD_IDS)[ids % len(HELD_IDS)]
    out = holder.per_expert_outputs(0, hidden, ids, weights, mask, check_held=False)  # [T, K, D]
    expected = replaced_rows(holder, 0, hidden, ids, weights, mask)
    assert_same_as_replaced(out, expected, mask)
    assert out.abs().amax() > 0
    if dtype != torch.float32:
        return
    reference = QuantizedRoutedExperts(
        {0: (HELD_IDS, [getattr(holder._layers[0], n) for n in ("w1", "s1", "w2", "s2", "w3", "s3")])}, NUM_ROUTED,
        LIMIT, expert_format=fmt, route_weight_before_w2=before_w2, backend=KernelBackend.TORCH)
    torch_path = reference.per_expert_outputs(0, hidden, ids, weights, mask)  # dequantised weights, F.linear
    assert ((out - torch_path).norm() / torch_path.norm()).item() < 1e-5


@interpreted
def test_rows_kernel_on_selected_rows_and_routed_sum_are_bit_identical():
    """`_rows_kernel` as the expert worker and the attention worker call it (stack indices [R, 1], the
    held check done), and `__call__`'s sum against the replaced composition's torch sum."""
    holder = random_holder(seed=4)
    held = holder._layers[0]
    hidden, ids, weights = random_routing(6, dtype=torch.float32, seed=5)
    ids = torch.tensor(HELD_IDS)[ids % len(HELD_IDS)]
    local = held.local[ids]  # [T, K] stack indices
    rows = holder._rows_kernel(held, hidden, local, weights)  # [T·K, D]
    expected = replaced_rows(holder, 0, hidden, ids, weights, None)
    assert torch.equal(bits(rows.view(expected.shape)), bits(expected))
    flat = torch.tensor([0, 4, 5, 9, 16])  # some slots, ascending
    selected = holder._rows_kernel(held, hidden[flat // TOP_K], local.reshape(-1)[flat, None],
                                   weights.reshape(-1)[flat, None])  # [5, D]
    assert torch.equal(bits(selected), bits(expected.reshape(-1, HIDDEN)[flat]))
    assert torch.equal(bits(sum_slots_kernel(rows.view(expected.shape))), bits(sum_slots_in_order_torch(expected)))


@interpreted
def test_masked_slots_are_zero_even_where_the_expert_gives_nan():
    holder = random_holder(seed=6)
    hidden, ids, weights = random_routing(4, dtype=torch.float32, seed=7)
    mask = holder.held_mask(0, ids)
    mask[2] = False
    hidden[2] = float("nan")  # token 2: every slot masked, its rows would be NaN
    ids[2] = 1  # an expert not held here: masked slots are not looked up
    out = holder.per_expert_outputs(0, hidden, ids, weights, mask, check_held=False)
    assert not bits(out[~mask]).any()
    assert torch.isfinite(out).all() and out[mask].abs().amax() > 0
    assert_same_as_replaced(out, replaced_rows(holder, 0, hidden, ids, weights, mask), mask)


@contextlib.contextmanager
def _counted_launches():
    """(kernel launches, torch ops run outside them) while the block runs under the interpreter."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    launches: list[str] = []
    torch_ops: list[str] = []
    inside = [0]
    original = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        inside[0] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0]:
                torch_ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    interpreter.GridExecutor.__call__ = counted
    try:
        with Recorder():
            yield launches, torch_ops
    finally:
        interpreter.GridExecutor.__call__ = original


# torch ops that launch nothing on a device: allocation without initialisation, views
NO_LAUNCH_OPS = {"empty", "view", "_reshape_alias", "as_strided", "alias", "detach", "unsqueeze", "slice", "select",
                 "expand", "t", "transpose", "reshape", "_unsafe_view"}


@interpreted
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_path_is_three_launches_and_the_sum_one(masked):
    from moemesh.common.kernels import split_k

    holder = random_holder(seed=8)
    hidden, ids, weights = random_routing(1, seed=9)
    ids = torch.tensor(HELD_IDS)[ids % len(HELD_IDS)]
    mask = torch.tensor([[True, False, True]]) if masked else None
    holder.per_expert_outputs(0, hidden, ids, weights, mask, check_held=False)  # split-K counters exist after it
    assert torch.device("cpu") in split_k._counters
    with _counted_launches() as (launches, torch_ops):
        per_slot = holder.per_expert_outputs(0, hidden, ids, weights, mask, check_held=False)
        sum_slots_kernel(per_slot)
    assert launches == ["_route_layout_kernel", "_grouped_kernel", "_grouped_kernel", "_sum_slots_kernel"]
    assert set(torch_ops) <= NO_LAUNCH_OPS, torch_ops


@interpreted
def test_glue_switches_pick_the_kernels_or_their_references(monkeypatch):
    """`sum_slots_in_order` runs the kernel where the glue runs Triton (CUDA; CPU under the interpreter
    hook), `MOEMESH_TORCH_GLUE=1` gives both torch references; the same bits either way."""
    from moemesh.common.kernels.glue import INTERPRET_ON_CPU_ENV, TORCH_GLUE_ENV
    from moemesh.common.kernels.moe_layout import sum_slots_in_order

    gen = torch.Generator().manual_seed(11)
    slots = torch.randn(2, 3, 40, generator=gen).to(torch.bfloat16)  # [T, K, D]
    ids, weights = torch.randint(0, 7, (4, 3), generator=gen), torch.rand(4, 3, generator=gen)
    results = {}
    for name, env in (("triton", INTERPRET_ON_CPU_ENV), ("torch", TORCH_GLUE_ENV)):
        monkeypatch.setenv(env, "1")
        with _counted_launches() as (launches, _):
            results[name] = sum_slots_in_order(slots), route_layout(ids, weights, 7)
        assert launches == (["_sum_slots_kernel", "_route_layout_kernel"] if name == "triton" else []), launches
    assert torch.equal(bits(results["triton"][0]), bits(results["torch"][0]))
    assert_same_layout(results["triton"][1], results["torch"][1])


# ------------------------------------------------------------------------------ sm_90 compilation
def _compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moemesh.bench.kernel_sass import summarise

    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    compiled = compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps})
    return summarise(compiled)


def _ptxas_present() -> bool:
    from moemesh.bench.kernel_sass import _tool

    return os.path.exists(_tool("ptxas"))


sm90 = pytest.mark.skipif(INTERPRETED or not _ptxas_present(), reason="compiles for sm_90 (not interpreted, ptxas)")


@sm90
@pytest.mark.parametrize("fused,split_k,x_rows,out_rows", [(True, 2, True, False), (False, 1, False, True),
                                                           (False, 2, False, True)])
def test_grouped_kernel_with_row_ids_compiles_for_sm90_without_spills(fused, split_k, x_rows, out_rows):
    from moemesh.common.kernels.fp4_experts_kernel import _grouped_kernel

    pointers = dict(zip(("x_ptr", "wa_ptr", "sa_ptr", "wb_ptr", "sb_ptr", "out_ptr", "offsets_ptr", "row_weights_ptr",
                         "partial_ptr", "counter_ptr"),
                        ("*bf16", "*u8", "*u8", "*u8", "*u8", "*bf16", "*i32", "*fp32", "*fp32", "*i32")))
    scalars = {name: "i32" for name in ("num_experts", "out_features", "stride_xr", "stride_we", "stride_wn",
                                        "stride_se", "stride_sn", "stride_or", "stride_ps")}
    signature = {**pointers, **scalars, "swiglu_limit": "fp32"}
    if x_rows:
        signature["x_rows_ptr"] = "*i32"
    if out_rows:
        signature.update(out_rows_ptr="*i32", num_rows="i32")
    constexprs = {"IN_FEATURES": 4096 if fused else 2048, "WEIGHT_FORMAT": 0, "FP4_DECODE": int(Fp4Decode.ASM_QUAD),
                  "FUSE_SWIGLU": fused, "HAS_LIMIT": fused, "HAS_ROW_WEIGHTS": not fused, "SPLIT_K": split_k,
                  "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_E": 256}
    summary = _compile_sm90(_grouped_kernel, signature, constexprs, num_warps=4)
    assert summary["stack_bytes"] == 0, summary
    assert summary["opcodes"].get("HGMMA", 0) > 0, "no Hopper wgmma in the main loop"


@sm90
@pytest.mark.parametrize("num_steps,block_rows,num_warps", [(1, 8, 4), (1, 256, 8), (8, 256, 8)])
def test_layout_and_sum_kernels_compile_for_sm90_without_spills(num_steps, block_rows, num_warps):
    from moemesh.common.kernels.route_layout import _route_layout_kernel, _sum_slots_kernel

    types = ["*i64", "*bf16", "*u8", "*i64", "*i32", "*i32", "*i32", "*fp32"] + ["i32"] * 9
    signature = dict(zip(_route_layout_kernel.arg_names, types))
    constexprs = {"HAS_TABLE": True, "HAS_MASK": True, "NUM_STEPS": num_steps, "BLOCK_R": block_rows,
                  "BLOCK_B": 512}
    assert _compile_sm90(_route_layout_kernel, signature, constexprs, num_warps)["stack_bytes"] == 0
    signature = dict(zip(_sum_slots_kernel.arg_names, ["*bf16", "*bf16"] + ["i32"] * 4))
    summary = _compile_sm90(_sum_slots_kernel, signature, {"TOP_K": 6, "IS_BF16": True, "BLOCK_D": 512}, 4)
    assert summary["stack_bytes"] == 0
