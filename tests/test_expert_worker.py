"""Expert worker in-process: grouping math, reading only its experts, Dispatch -> Combine, placements."""

from __future__ import annotations

import asyncio

import pytest
import torch

from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.kernels.moe_layout import sum_slots_in_order
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.wire.messages import Combine, Dispatch, ErrorCode, ErrorReply, ExpertInventory, QueryInventory
from moemesh.services.expert.grouping import group_by_expert, slot_outputs
from moemesh.common.placement.worker_holdings import WorkerHoldings, contiguous, owner_table, round_robin
from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config()
    path = tmp_path_factory.mktemp("expert_ckpt")
    write_checkpoint(path, config, random_hub_state_dict(config, seed=3, include_mtp=False))
    return path, config


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k].sort().values
                       for _ in range(num_tokens)])  # [T, K] ascending like the gate
    weights = torch.rand(num_tokens, top_k, generator=generator)
    return ids, weights


def test_grouped_slot_outputs_are_bit_identical_to_the_reference_holder():
    torch.manual_seed(0)
    num_experts, hidden, inter = 6, 16, 8
    weights_of = {(1, e): (torch.randn(inter, hidden), torch.randn(hidden, inter), torch.randn(inter, hidden))
                  for e in range(num_experts)}
    x = torch.randn(11, hidden)
    ids, route = _routing(11, num_experts, 3, seed=1)
    mask = torch.rand(11, 3, generator=torch.Generator().manual_seed(2)) < 0.6
    reference = RoutedExperts(weights_of, 7.0).per_expert_outputs(1, x, ids, route, slot_mask=mask)
    groups = group_by_expert(ids, mask)
    assert groups.expert_ids == sorted(set(ids[mask].tolist()))
    ours = slot_outputs(weights_of, 1, x, groups, route, 3, 7.0, route_weight_before_w2=False)
    assert torch.equal(ours, reference)
    assert torch.equal(ours[~mask], torch.zeros_like(ours[~mask]))


def test_worker_reads_only_its_experts_and_reports_them(checkpoint):
    path, config = checkpoint
    pairs = ((0, 1), (2, 5), (3, 0))
    worker = ExpertWorker(ExpertWorkerConfig(name="expert-x", checkpoint_path=str(path), pairs=pairs))
    asyncio.run(worker.load())
    read = set(worker.read_entry_names)
    assert read and all(".ffn.experts." in name for name in read)
    assert {tuple(int(p) for p in name.split(".")[1:5:3]) for name in read} == set(pairs)
    inventory = asyncio.run(worker.handle(QueryInventory()))
    assert isinstance(inventory, ExpertInventory)
    assert [(k.layer, k.expert) for k in inventory.experts] == list(pairs)
    fp4_matrix_bytes = config.moe_intermediate_size * config.hidden_size * (1 / 2 + 1 / 32)  # e2m1 + ue8m0 per 32
    assert inventory.num_weight_bytes == 3 * 3 * fp4_matrix_bytes  # kept as stored: FP4 stacks
    assert inventory.num_stored_weight_bytes == inventory.num_weight_bytes
    assert inventory.memory_used_bytes > 0 and inventory.device == "cpu"


def test_dispatch_partial_sum_and_per_slot_outputs(checkpoint):
    path, config = checkpoint
    layer = 2
    held = tuple((layer, e) for e in range(0, config.n_routed_experts, 2))  # even experts
    worker = ExpertWorker(ExpertWorkerConfig(name="expert-even", checkpoint_path=str(path), pairs=held))
    asyncio.run(worker.load())
    everything = ExpertWorker(ExpertWorkerConfig(name="all", checkpoint_path=str(path),
                                                 pairs=tuple((layer, e) for e in range(config.n_routed_experts))))
    asyncio.run(everything.load())
    x = torch.randn(9, config.hidden_size)
    ids, route = _routing(9, config.n_routed_experts, config.num_experts_per_tok, seed=5)
    mask = ids % 2 == 0
    for per_expert in (False, True):
        dispatch = Dispatch(dispatch_id=7, step_id=1, layer=layer, micro_batch=0, hidden=x,
                            expert_ids=ids.int(), weights=route, per_expert_outputs=per_expert, slot_mask=mask)
        combine = asyncio.run(worker.handle(dispatch))
        assert isinstance(combine, Combine) and combine.dispatch_id == 7 and combine.layer == layer
        full = everything.handle_dispatch(Dispatch(dispatch_id=8, step_id=1, layer=layer, micro_batch=0, hidden=x,
                                                   expert_ids=ids.int(), weights=route, per_expert_outputs=True))
        expected = torch.where(mask[..., None], full.output, torch.zeros_like(full.output))
        if per_expert:
            assert torch.equal(combine.output, expected)
        else:
            assert torch.equal(combine.output, sum_slots_in_order(expected))
    unheld = Dispatch(dispatch_id=9, step_id=1, layer=layer, micro_batch=0, hidden=x, expert_ids=ids.int(),
                      weights=route)  # no mask: odd experts too
    reply = worker.handle_dispatch(unheld)
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NOT_FOUND


def test_placements_cover_every_pair_once():
    names, devices = ["a", "b", "c"], ["cpu"] * 3
    for build in (round_robin, contiguous):
        placement = build(names, devices, 4, 8, 1000)
        holdings = [WorkerHoldings(w.name, w.expert_ids) for w in placement.workers]
        owner = owner_table(holdings, 4, 8)
        assert sorted(p for h in holdings for p in h.primary) == [(l, e) for l in range(4) for e in range(8)]
        assert all(owner[l][e] == next(i for i, h in enumerate(holdings) if (l, e) in h.primary)
                   for l in range(4) for e in range(8))
    assert owner_table([WorkerHoldings("a", ((0, 0),), ()), WorkerHoldings("b", ((0, 1),), ((0, 0),))], 1, 2) == [[0, 1]]
    with pytest.raises(ValueError):
        owner_table([WorkerHoldings("a", ((0, 0),))], 1, 2)
