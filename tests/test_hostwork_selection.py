"""Host-side row selection of the quantized expert worker (services/expert/selection.py) and the worker's
refusals: the selection equals the device-side one it replaced, a malformed Dispatch is answered, not raised."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.wire.messages import Dispatch, ErrorCode, ErrorReply
from moemesh.services.expert.selection import held_table, routing_on_host, select_rows

NUM_EXPERTS = 32


def _routing(num_tokens: int, top_k: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(NUM_EXPERTS, generator=generator)[:top_k] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    mask = torch.rand(num_tokens, top_k, generator=generator) < 0.6
    return ids, mask


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64])
def test_selection_equals_the_device_style_reference(num_tokens):
    ids, mask = _routing(num_tokens, 6, seed=num_tokens)
    held_ids = list(range(0, NUM_EXPERTS, 2)) + [5]
    table = held_table(held_ids, NUM_EXPERTS)
    mask &= table.held[ids]  # every selected slot held
    selection = select_rows(ids, mask, table, NUM_EXPERTS)
    (flat,) = torch.where(mask.reshape(-1))  # what the worker did on the device before
    assert torch.equal(selection.flat_slots, flat)
    assert torch.equal(selection.row_tokens, flat // 6)
    stack_index = {e: i for i, e in enumerate(sorted(held_ids))}
    assert selection.row_local.tolist() == [stack_index[e] for e in ids.reshape(-1)[flat].tolist()]
    assert selection.missing_expert_ids == ()
    assert selection.num_rows == int(mask.sum())
    every = select_rows(ids, None, held_table(range(NUM_EXPERTS), NUM_EXPERTS), NUM_EXPERTS)
    assert torch.equal(every.flat_slots, torch.arange(ids.numel()))


def test_selection_names_missing_experts_and_rejects_ids_out_of_range():
    ids = torch.tensor([[3, 4, 9], [4, 9, 11]])
    mask = torch.tensor([[True, True, False], [False, True, True]])
    table = held_table([3, 11], NUM_EXPERTS)
    assert select_rows(ids, mask, table, NUM_EXPERTS).missing_expert_ids == (4, 9)
    assert select_rows(ids, mask, None, NUM_EXPERTS).missing_expert_ids == (3, 4, 9, 11)  # layer not held at all
    assert select_rows(ids, ~mask, table, NUM_EXPERTS).missing_expert_ids == (4, 9)
    only_held = torch.tensor([[True, False, False], [False, False, True]])  # 3 and 11: unselected ones do not count
    assert select_rows(ids, only_held, table, NUM_EXPERTS).missing_expert_ids == ()
    for bad in (NUM_EXPERTS, -1):
        problem = select_rows(torch.tensor([[1, bad]]), None, table, NUM_EXPERTS)
        assert isinstance(problem, str) and "outside" in problem


def test_routing_on_host_keeps_host_tensors():
    ids, mask = _routing(5, 4, seed=1)
    host_ids, host_mask = routing_on_host(ids.to(torch.int32), mask)
    assert host_ids.dtype == torch.int64 and torch.equal(host_ids, ids) and host_mask is mask


@pytest.fixture(scope="module")
def cpu_worker():
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import flash_config
    from moemesh.bench.hostwork import random_held_experts
    from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig

    config = flash_config([AttentionKind.CSA], hidden_size=256, moe_intermediate_size=128,
                          n_routed_experts=NUM_EXPERTS)
    pairs = [(0, e) for e in range(0, NUM_EXPERTS, 2)]
    worker = ExpertWorker(ExpertWorkerConfig(name="sel", checkpoint_path="", device="cpu"), config)
    worker.holdings.adopt(random_held_experts(config, pairs, "cpu", seed=4))
    worker.allocate_staging()
    return worker


def _dispatch(ids, mask, hidden_size=256, **fields):
    generator = torch.Generator().manual_seed(7)
    return Dispatch(dispatch_id=1, step_id=1, layer=0, micro_batch=0,
                    hidden=fields.get("hidden", torch.randn(ids.shape[0], hidden_size, generator=generator)),
                    expert_ids=ids.to(torch.int32),
                    weights=fields.get("weights", torch.rand(ids.shape, generator=generator)),
                    per_expert_outputs=fields.get("per_expert_outputs", False), slot_mask=mask)


def test_cpu_worker_output_equals_the_legacy_path(cpu_worker):
    from moemesh.bench.hostwork_legacy import legacy_expert_stages

    ids, mask = _routing(9, 6, seed=3)
    mask &= ids % 2 == 0
    mask[:, 0] |= ids[:, 0] % 2 == 0
    for per_expert in (False, True):
        dispatch = _dispatch(ids, mask, per_expert_outputs=per_expert)
        reply = cpu_worker.handle_dispatch(dispatch)
        assert not isinstance(reply, ErrorReply), reply
        assert torch.equal(reply.output, legacy_expert_stages(cpu_worker, dispatch, {}))
        assert reply.output.abs().sum() > 0


def test_cpu_worker_answers_malformed_and_unheld_dispatches(cpu_worker):
    ids = torch.tensor([[2, 3], [4, 6]])
    refused = cpu_worker.handle_dispatch(_dispatch(ids, torch.tensor([[True, True], [True, False]])))
    assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.NOT_FOUND
    assert "does not hold layer 0 experts [3]" in refused.message
    out_of_range = cpu_worker.handle_dispatch(_dispatch(torch.tensor([[2, NUM_EXPERTS + 7]]), None))
    assert isinstance(out_of_range, ErrorReply) and out_of_range.code == ErrorCode.MALFORMED
    wrong_shape = cpu_worker.handle_dispatch(_dispatch(ids, None, weights=torch.rand(2, 3)))
    assert isinstance(wrong_shape, ErrorReply) and wrong_shape.code == ErrorCode.MALFORMED
    other_layer = cpu_worker.handle_dispatch(Dispatch(
        dispatch_id=2, step_id=1, layer=5, micro_batch=0, hidden=torch.randn(1, 256),
        expert_ids=torch.tensor([[2, 4]], dtype=torch.int32), weights=torch.rand(1, 2), per_expert_outputs=False))
    assert isinstance(other_layer, ErrorReply) and other_layer.code == ErrorCode.NOT_FOUND
    ok = cpu_worker.handle_dispatch(_dispatch(ids, torch.tensor([[True, False], [True, True]])))
    assert not isinstance(ok, ErrorReply)  # the worker still answers after the refusals


@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_host_layout_equals_the_device_layout_of_the_grouped_kernels(num_tokens):
    """selection.sorted_layout against `quantized.layout_by_expert` on the same rows (what the kernels saw)."""
    from moemesh.common.model.quantized_experts import layout_by_expert
    from moemesh.services.expert.selection import sorted_layout

    ids, mask = _routing(num_tokens, 6, seed=10 + num_tokens)
    held_ids = list(range(1, NUM_EXPERTS, 3))
    table = held_table(held_ids, NUM_EXPERTS)
    mask &= table.held[ids]
    mask[:, 0] = table.held[ids[:, 0]]
    selection = select_rows(ids, mask, table, NUM_EXPERTS)
    num_rows = selection.num_rows
    layout = torch.from_numpy(sorted_layout(selection, len(held_ids)))
    device_layout = layout_by_expert(selection.row_local[:, None], len(held_ids))
    assert torch.equal(layout[:num_rows], selection.flat_slots[device_layout.row_slot_ids])
    assert torch.equal(layout[num_rows:2 * num_rows], selection.row_tokens[device_layout.row_token_ids])
    assert torch.equal(layout[2 * num_rows:], device_layout.expert_offsets.long())
    assert layout[-1] == num_rows and len(layout) == 2 * num_rows + len(held_ids) + 1
