"""Sort routed token copies by expert: the layout the grouped expert kernels read; and the one order
in which every holder of experts adds a token's K slot outputs (`sum_slots_in_order`), so that
results do not depend on placement.

Legend: T tokens, K top-k, E experts, R = T*K routed rows, D hidden.

All of this stays on the device and never synchronises with the host, so it can run inside a
CUDA graph: the number of rows per expert is only known on the device, and the grouped kernels
read it from `expert_offsets` themselves. `route_layout.py` builds the same stable layout in one
Triton launch (what the quantized experts' kernel path reads) and runs the slot sum in one launch
on CUDA; the torch code here is the reference of both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertLayout:
    """Rows sorted by expert.

    `row_token_ids` [R] int64: which token each sorted row copies (index into x [T, D]).
    `row_slot_ids` [R] int64: the flat index t*K + k of the (token, top-k slot) the row came from,
      so that `topk_weights.flatten()[row_slot_ids]` gives each row its routing weight.
    `expert_offsets` [E+1] int32: rows `expert_offsets[e] : expert_offsets[e+1]` go to expert e;
      non-decreasing, first 0, last R.
    """

    row_token_ids: torch.Tensor
    row_slot_ids: torch.Tensor
    expert_offsets: torch.Tensor


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertLayout:
    """Stable sort of the [T, K] expert choices; rows of one expert keep token order."""
    num_tokens, top_k = topk_ids.shape
    flat_expert_ids = topk_ids.reshape(-1)  # [R]
    row_slot_ids = torch.sort(flat_expert_ids, stable=True).indices  # [R]
    counts = torch.bincount(flat_expert_ids, minlength=num_experts)  # [E]
    expert_offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    expert_offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return ExpertLayout(
        row_token_ids=row_slot_ids // top_k,
        row_slot_ids=row_slot_ids,
        expert_offsets=expert_offsets,
    )


def combine_rows(rows: torch.Tensor, layout: ExpertLayout, num_tokens: int) -> torch.Tensor:
    """Sum weighted expert output rows [R, D] back into tokens: fp32 [T, D]."""
    out = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    out.index_add_(0, layout.row_token_ids, rows.to(torch.float32))
    return out


def sum_slots_in_order(slot_outputs: torch.Tensor) -> torch.Tensor:
    """[T, K, D] -> [T, D], adding slot 0, then 1, ... (a fixed order, independent of placement).

    On CUDA one Triton launch (`route_layout.sum_slots_kernel`, bit-identical to the torch loop) where
    the glue runs Triton (`glue.use_triton_glue`); elsewhere, and for dtypes or layouts the kernel does
    not take, the torch loop."""
    from moemesh.common.kernels.glue import use_triton_glue

    if (slot_outputs.dim() == 3 and slot_outputs.shape[1] > 0 and slot_outputs.stride(2) == 1
            and use_triton_glue(slot_outputs)):
        from moemesh.common.kernels.route_layout import SUM_DTYPES, sum_slots_kernel

        if slot_outputs.dtype in SUM_DTYPES:
            return sum_slots_kernel(slot_outputs)
    return sum_slots_in_order_torch(slot_outputs)


def sum_slots_in_order_torch(slot_outputs: torch.Tensor) -> torch.Tensor:
    """Reference of `sum_slots_in_order`: K - 1 in-place additions after a copy of slot 0 ([T, K, D] -> [T, D])."""
    total = slot_outputs[:, 0].clone()
    for slot in range(1, slot_outputs.shape[1]):
        total += slot_outputs[:, slot]
    return total
