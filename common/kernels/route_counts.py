"""Per-(phase, layer, expert) routing counts: `count_routes` and its torch reference.

Legend: T tokens, K top-k slots, P planes (phases, then the plane of rows not counted), L layers, E experts.

A MoE layer's top-k ids [T, K] add one each to planes [P, L, E] int64 at (phase of the token, layer, id),
phase 0 for every token when none is given. The reference is torch's index_add_ over the flat index (six
small kernels on a GPU: cast, offsets, phase broadcast, ones, the add); on CUDA `count_routes` runs the one
Triton launch of `route_counts_kernel` instead (integer atomics: exact, in any order, replayable in a CUDA
graph). Neither reads anything back to the host. Tests: tests/test_route_counts.py (the kernel under the
interpreter on the CPU against the reference).
"""

from __future__ import annotations

import torch

from moemesh.common.kernels.glue import use_triton_glue


def count_routes(planes: torch.Tensor, layer: int, ids: torch.Tensor, phase: torch.Tensor | None) -> None:
    """planes [P, L, E] int64 += 1 at (phase[t], layer, ids[t, k]) for every slot; phase [T] bool or int64 on
    the ids' device (None: plane 0). One launch where the glue kernels run, the reference elsewhere."""
    if use_triton_glue(ids):
        from moemesh.common.kernels.route_counts_kernel import count_routes_kernel

        count_routes_kernel(planes, layer, ids, phase)
    else:
        count_routes_reference(planes, layer, ids, phase)


def count_routes_reference(planes: torch.Tensor, layer: int, ids: torch.Tensor, phase: torch.Tensor | None) -> None:
    """The definition: planes.view(-1).index_add_ of ones at the flat (phase, layer, id) index of each slot."""
    num_layers, num_experts = planes.shape[1], planes.shape[2]
    flat = ids.reshape(-1).long() + layer * num_experts  # [T*K]
    if phase is not None:
        per_slot = phase.to(device=ids.device, dtype=torch.long)[:, None].expand_as(ids).reshape(-1)  # [T*K]
        flat = flat + per_slot * (num_layers * num_experts)
    planes.view(-1).index_add_(0, flat, torch.ones_like(flat))
