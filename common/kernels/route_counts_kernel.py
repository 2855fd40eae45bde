"""The routing-count kernel (Triton) behind `route_counts.count_routes`: one launch per MoE layer.

Legend: T tokens, K top-k slots, P planes, L layers, E experts. Each program reads BLOCK slots' expert ids
and their tokens' phases and adds one to planes [P, L, E] int64 at (phase, layer, id) with integer atomics:
exact, and the same in any order. Its torch reference and tests are those of `route_counts.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dependent_launch import dependent_launch, wait_for_inputs

BLOCK_SLOTS = 1024  # slots a program counts


@triton.jit
def _count_routes_kernel(planes_ptr, ids_ptr, phase_ptr, num_slots, top_k, layer_offset, plane_size,
                         HAS_PHASE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat slot t*K + k
    mask = slots < num_slots
    flat = tl.load(ids_ptr + slots, mask=mask, other=0).to(tl.int64) + layer_offset  # [BLOCK]
    if HAS_PHASE:
        phase = tl.load(phase_ptr + slots // top_k, mask=mask, other=0).to(tl.int64)  # [BLOCK]
        flat += phase * plane_size
    tl.atomic_add(planes_ptr + flat, tl.full([BLOCK], 1, tl.int64), mask=mask, sem="relaxed")


def count_routes_kernel(planes: torch.Tensor, layer: int, ids: torch.Tensor, phase: torch.Tensor | None) -> None:
    """As `route_counts.count_routes_reference`, in one launch. ids [T, K] int32 / int64, phase [T] bool or
    int64 on the same device (phase values index planes: 0 .. P - 1)."""
    if planes.dtype != torch.int64 or planes.dim() != 3 or not planes.is_contiguous():
        raise ValueError(f"planes must be contiguous int64 [P, L, E], got {planes.dtype} {tuple(planes.shape)}")
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 / int64 [T, K], got {ids.dtype} {tuple(ids.shape)}")
    num_tokens, top_k = ids.shape
    if phase is not None and (phase.shape != (num_tokens,) or phase.device != ids.device):
        raise ValueError(f"phase must be [{num_tokens}] on {ids.device}, got {tuple(phase.shape)} on {phase.device}")
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return
    ids = ids.contiguous()
    if phase is not None:
        phase = phase.contiguous().view(torch.uint8) if phase.dtype == torch.bool else phase.contiguous()
    num_layers, num_experts = planes.shape[1], planes.shape[2]
    _count_routes_kernel[(triton.cdiv(num_slots, BLOCK_SLOTS),)](
        planes, ids, phase if phase is not None else ids, num_slots, top_k, layer * num_experts,
        num_layers * num_experts, HAS_PHASE=phase is not None, BLOCK=BLOCK_SLOTS, num_warps=4,
        **dependent_launch(ids.device))
