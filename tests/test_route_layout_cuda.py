"""The routed-expert kernel path on CUDA at V4-Flash sizes (D 4096, I 2048, 256 experts, top-6, bf16):
the one-launch route layout and slot sum against their torch references, `QuantizedRoutedExperts`
bit for bit against the composition it replaced (tests/test_route_layout.py: `replaced_rows`), the
long-row and long-prefill paths, the launches one decode layer costs (profiler), and CUDA-graph
replays (skips without a GPU).
Legend: T tokens, K top-k, R = T·K rows, E experts, D hidden, I expert width.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
triton = pytest.importorskip("triton")

from moemesh.common.kernels.moe_layout import sum_slots_in_order, sum_slots_in_order_torch  # noqa: E402
from moemesh.common.kernels.route_layout import (KERNEL_MAX_ROWS, route_layout_kernel, route_layout_torch,  # noqa: E402
                                                 sum_slots_kernel)
from moemesh.common.model.quantized_experts import ExpertFormat, _unsort_rows, layout_by_expert  # noqa: E402
from test_route_layout import (assert_same_as_replaced, assert_same_layout, bits, random_holder,  # noqa: E402
                               random_routing, replaced_rows)

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 256, 4096, 2048, 6
FLASH = dict(num_routed=NUM_EXPERTS, hidden=HIDDEN, inter=INTER, device="cuda")


@pytest.fixture(scope="module")
def every_expert():
    """FP4, every expert of the layer held (stack index = expert id)."""
    return random_holder(ExpertFormat.FP4, held_ids=list(range(NUM_EXPERTS)), seed=1, **FLASH)


@pytest.fixture(scope="module")
def even_experts():
    """FP4, the even experts held (stack index = id / 2): slots of odd experts must be masked out."""
    return random_holder(ExpertFormat.FP4, held_ids=list(range(0, NUM_EXPERTS, 2)), seed=2, **FLASH)


def _routing(num_tokens: int, seed: int):
    return random_routing(num_tokens, num_routed=NUM_EXPERTS, top_k=TOP_K, hidden=HIDDEN, dtype=torch.bfloat16,
                          device="cuda", seed=seed)


# ------------------------------------------------------------------------------ the two kernels
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 300, KERNEL_MAX_ROWS // TOP_K])
@pytest.mark.parametrize("with_mask", [False, True])
def test_layout_kernel_equals_torch_layout(num_tokens, with_mask):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    ids = torch.randint(0, NUM_EXPERTS, (num_tokens, TOP_K), generator=gen, device="cuda")
    table = torch.randperm(NUM_EXPERTS, generator=gen, device="cuda")
    mask = torch.rand(num_tokens, TOP_K, generator=gen, device="cuda") < 0.5 if with_mask else None
    weights = torch.rand(num_tokens, TOP_K, generator=gen, device="cuda")
    for stack_table in (None, table):
        assert_same_layout(route_layout_kernel(ids, weights, NUM_EXPERTS, stack_table=stack_table, slot_mask=mask),
                           route_layout_torch(ids, weights, NUM_EXPERTS, stack_table=stack_table, slot_mask=mask))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_slot_sum_is_bit_identical_to_torch(dtype, num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    slots = (torch.randn(num_tokens, TOP_K, HIDDEN, generator=gen, device="cuda") * 100).to(dtype)  # [T, K, D]
    reference = sum_slots_in_order_torch(slots)
    assert torch.equal(bits(sum_slots_kernel(slots)), bits(reference))
    assert torch.equal(bits(sum_slots_in_order(slots)), bits(reference))  # the CUDA dispatch takes the kernel


# ------------------------------------------------------------------------------ the kernel path
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 300])
@pytest.mark.parametrize("masked", [False, True])
def test_every_expert_bit_identical_to_the_replaced_composition(every_expert, num_tokens, masked):
    hidden, ids, weights = _routing(num_tokens, seed=num_tokens)
    mask = torch.rand(ids.shape, device="cuda") < 0.5 if masked else None
    out = every_expert.per_expert_outputs(0, hidden, ids, weights, mask, check_held=False)  # [T, K, D]
    expected = replaced_rows(every_expert, 0, hidden, ids, weights, mask)
    assert_same_as_replaced(out, expected, mask)
    if not masked:
        assert torch.equal(bits(every_expert(0, hidden, ids, weights)), bits(sum_slots_in_order_torch(expected)))


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_subset_holder_with_its_mask_is_bit_identical(even_experts, num_tokens):
    hidden, ids, weights = _routing(num_tokens, seed=7 + num_tokens)
    mask = even_experts.held_mask(0, ids)
    out = even_experts.per_expert_outputs(0, hidden, ids, weights, mask, check_held=False)
    assert_same_as_replaced(out, replaced_rows(even_experts, 0, hidden, ids, weights, mask), mask)
    checked = even_experts.per_expert_outputs(0, hidden, ids, weights, mask)  # the held check passes
    assert torch.equal(bits(checked), bits(out))


@pytest.mark.parametrize("fmt,before_w2", [(ExpertFormat.FP8, False), (ExpertFormat.FP4, True)])
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_fp8_and_weight_before_w2_bit_identical(fmt, before_w2, num_tokens):
    num_experts = 32
    holder = random_holder(fmt, held_ids=list(range(num_experts)), num_routed=num_experts, hidden=HIDDEN, inter=INTER,
                           before_w2=before_w2, device="cuda", seed=3)
    hidden, ids, weights = random_routing(num_tokens, num_routed=num_experts, top_k=TOP_K, hidden=HIDDEN,
                                          dtype=torch.bfloat16, device="cuda", seed=4)
    mask = torch.rand(ids.shape, device="cuda") < 0.7
    for slot_mask in (None, mask):
        out = holder.per_expert_outputs(0, hidden, ids, weights, slot_mask, check_held=False)
        assert_same_as_replaced(out, replaced_rows(holder, 0, hidden, ids, weights, slot_mask), slot_mask)


def test_rows_kernel_on_selected_rows_is_bit_identical(every_expert):
    """`_rows_kernel` as the expert worker and the attention worker call it: stack indices [R, 1]."""
    hidden, ids, weights = _routing(16, seed=11)
    expected = replaced_rows(every_expert, 0, hidden, ids, weights, None).reshape(-1, HIDDEN)  # [T·K, D]
    flat = torch.nonzero(torch.rand(ids.numel(), device="cuda") < 0.4).squeeze(1)  # [R] ascending slots
    held = every_expert._layers[0]
    stack_index = held.local[ids.reshape(-1)[flat]]  # [R]
    rows = every_expert._rows_kernel(held, hidden.index_select(0, flat // TOP_K), stack_index[:, None],
                                     weights.reshape(-1)[flat][:, None])  # [R, D]
    assert torch.equal(bits(rows), bits(expected[flat]))


def test_masked_slots_are_zero_even_where_the_expert_gives_nan(every_expert):
    hidden, ids, weights = _routing(4, seed=12)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1] = False
    hidden[1] = float("nan")
    out = every_expert.per_expert_outputs(0, hidden, ids, weights, mask, check_held=False)
    assert not bits(out[1]).any() and torch.isfinite(out).all()


def test_forced_torch_glue_gives_the_same_bits(every_expert, monkeypatch):
    """`MOEMESH_TORCH_GLUE=1`: torch layout and torch slot sum around the same grouped kernels."""
    hidden, ids, weights = _routing(4, seed=19)
    mask = torch.rand(ids.shape, device="cuda") < 0.5
    kernels = every_expert(0, hidden, ids, weights), every_expert.per_expert_outputs(0, hidden, ids, weights, mask)
    monkeypatch.setenv("MOEMESH_TORCH_GLUE", "1")
    forced = every_expert(0, hidden, ids, weights), every_expert.per_expert_outputs(0, hidden, ids, weights, mask)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(kernels, forced))


def test_rows_past_the_layout_kernel_take_the_torch_layout(every_expert, monkeypatch):
    """R above KERNEL_MAX_ROWS, fused kernels (no dequant path): the torch layout, same bits."""
    monkeypatch.setenv("MOEMESH_EXPERT_PREFILL", "fused")
    hidden, ids, weights = _routing(KERNEL_MAX_ROWS // TOP_K + 60, seed=13)
    mask = torch.rand(ids.shape, device="cuda") < 0.8
    for slot_mask in (None, mask):
        out = every_expert.per_expert_outputs(0, hidden, ids, weights, slot_mask, check_held=False)
        assert_same_as_replaced(out, replaced_rows(every_expert, 0, hidden, ids, weights, slot_mask), slot_mask)


def test_long_prefill_dequant_path_is_unchanged(every_expert, monkeypatch):
    from moemesh.common.kernels.fp4_prefill import grouped_experts_dequant

    monkeypatch.setenv("MOEMESH_EXPERT_PREFILL", "dequant")
    hidden, ids, weights = _routing(64, seed=14)
    mask = torch.rand(ids.shape, device="cuda") < 0.8
    held = every_expert._layers[0]
    layout = layout_by_expert(held.local[ids], NUM_EXPERTS)
    y = grouped_experts_dequant(hidden[layout.row_token_ids], layout.expert_offsets, held.kernel_weights(),
                                swiglu_limit=every_expert.swiglu_limit,
                                row_weights=weights.reshape(-1)[layout.row_slot_ids].float())
    expected = _unsort_rows(y, layout.row_slot_ids).view(*ids.shape, -1)  # [T, K, D]
    out = every_expert.per_expert_outputs(0, hidden, ids, weights, mask, check_held=False)
    assert torch.equal(bits(out), bits(expected * mask[..., None].to(expected.dtype)))
    assert torch.equal(bits(every_expert(0, hidden, ids, weights)), bits(sum_slots_in_order_torch(expected)))


# ------------------------------------------------------------------------------ launches and graphs
def _device_activities(run) -> list[str]:
    """Names of the device activities (kernels, memsets, copies) `run()` causes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.device_type == DeviceType.CUDA]


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_a_decode_layer_is_four_launches(every_expert, num_tokens):
    hidden, ids, weights = _routing(num_tokens, seed=15)
    mask = torch.rand(ids.shape, device="cuda") < 0.5
    calls = {
        "routed_sum": (lambda: every_expert(0, hidden, ids, weights), 4),
        "per_slot": (lambda: every_expert.per_expert_outputs(0, hidden, ids, weights, check_held=False), 3),
        "per_slot_masked": (lambda: every_expert.per_expert_outputs(0, hidden, ids, weights, mask,
                                                                    check_held=False), 3),
        "per_slot_masked_then_sum": (lambda: sum_slots_in_order(every_expert.per_expert_outputs(
            0, hidden, ids, weights, mask, check_held=False)), 4),
    }
    for name, (run, expected) in calls.items():
        run()  # compiled, split-K counters allocated
        activities = _device_activities(run)
        assert len(activities) == expected, (name, activities)


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_graph_replays_equal_eager(every_expert, num_tokens):
    hidden, ids, weights = _routing(num_tokens, seed=16)
    mask = torch.rand(ids.shape, device="cuda") < 0.5

    def layer():
        return (every_expert(0, hidden, ids, weights),
                every_expert.per_expert_outputs(0, hidden, ids, weights, mask, check_held=False))

    layer()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_sum, static_per_slot = layer()
    for seed in (17, 18):
        new_hidden, new_ids, new_weights = _routing(num_tokens, seed=seed)
        hidden.copy_(new_hidden)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        mask.copy_(torch.rand(ids.shape, device="cuda") < 0.5)
        graph.replay()
        eager_sum, eager_per_slot = layer()
        assert torch.equal(bits(static_sum), bits(eager_sum))
        assert torch.equal(bits(static_per_slot), bits(eager_per_slot))
