"""Routing counts in one launch (common/kernels/route_counts_kernel.py) against their torch reference
(route_counts.py), exactly: random ids with repeats, int32 and int64 ids, bool and int64 phases, no phase,
a count spread over several programs; and the attention worker's counter through it. CPU: the kernel under
TRITON_INTERPRET=1 (in a child pytest when this process does not interpret); CUDA: the compiled kernel.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from interpret_support import INTERPRETING, cuda, interpreted, run_interpreted_tests  # noqa: E402
from moemesh.common.kernels.route_counts import count_routes_reference  # noqa: E402

CASES = [  # (tokens, top_k, experts, layers, phase kind)
    (1, 6, 16, 3, "bool"),
    (5, 4, 8, 2, "index"),
    (300, 6, 32, 2, None),  # 1,800 slots: two programs
    (7, 2, 4, 1, "index"),
]


def _case(num_tokens, top_k, num_experts, num_layers, phase_kind, ids_dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator).to(ids_dtype).to(device)
    if phase_kind == "bool":
        phase = (torch.rand(num_tokens, generator=generator) < 0.5).to(device)
    elif phase_kind == "index":
        phase = torch.randint(0, 3, (num_tokens,), generator=generator).to(device)
    else:
        phase = None
    planes = torch.randint(0, 5, (3, num_layers, num_experts), generator=generator).to(device)
    return planes, ids, phase


def _check_against_reference(device):
    from moemesh.common.kernels.route_counts_kernel import count_routes_kernel

    for seed, (num_tokens, top_k, num_experts, num_layers, phase_kind) in enumerate(CASES):
        for ids_dtype in (torch.int32, torch.int64):
            planes, ids, phase = _case(num_tokens, top_k, num_experts, num_layers, phase_kind, ids_dtype, device, seed)
            want = planes.clone()
            count_routes_reference(want, num_layers - 1, ids, phase)
            count_routes_kernel(planes, num_layers - 1, ids, phase)
            assert torch.equal(planes, want), (num_tokens, top_k, phase_kind, ids_dtype)
            assert int((planes - _case(num_tokens, top_k, num_experts, num_layers, phase_kind, ids_dtype, device,
                                       seed)[0]).sum()) == num_tokens * top_k  # every slot counted once


def test_reference_counts_every_slot_in_its_phase_plane():
    planes = torch.zeros(3, 2, 4, dtype=torch.long)
    count_routes_reference(planes, 1, torch.tensor([[0, 3], [3, 3]]), torch.tensor([True, False]))
    assert planes[1, 1].tolist() == [1, 0, 0, 1] and planes[0, 1].tolist() == [0, 0, 0, 2]
    assert int(planes.sum()) == 4 and int(planes[:, 0].sum()) == 0


@interpreted
def test_interpreted_kernel_matches_the_reference():
    _check_against_reference("cpu")


@interpreted
def test_interpreted_routing_counter_counts_through_the_kernel(monkeypatch):
    from moemesh.common.kernels.glue import INTERPRET_ON_CPU_ENV
    from moemesh.services.attention.routing_stats import RoutingCounter

    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")
    counter = RoutingCounter(num_layers=2, num_experts=8, num_experts_per_tok=2, device=torch.device("cpu"))
    counter.add(1, torch.tensor([[1, 2], [2, 7]], dtype=torch.int32), torch.tensor([2, 1]))  # 2: not counted
    counter.add(0, torch.tensor([[5, 5]]), None)
    assert counter.counts[1, 1].tolist() == [0, 0, 1, 0, 0, 0, 0, 1]
    assert counter.counts[0, 0].tolist() == [0, 0, 0, 0, 0, 2, 0, 0]
    assert int(counter.counts.sum()) == 4  # the padding row's slots went to the plane nothing reads


@cuda
def test_compiled_kernel_matches_the_reference():
    _check_against_reference("cuda")


def test_interpreted_cases_in_a_child():
    if INTERPRETING:
        pytest.skip("this process interprets: the cases run here")
    run_interpreted_tests(__file__)
