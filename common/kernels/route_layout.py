"""The routed-expert row layout in one launch, and the in-order slot sum in one launch.

Why: in decode the torch composition these replace (stable torch.sort, searchsorted, gathers of x and
of the route weights, the unsort, the slot-mask multiply, K - 1 in-place adds) is some twenty 1-7 µs
launches per layer around the two grouped matmuls; with these and the grouped kernels' row indices
(`fp4_experts`: x read through the row's token, results written to the row's slot) a layer's routed
experts are four launches: layout, gate-up, down, slot sum (three where the slots go to hc_post unsummed).

Legend: T tokens, K top-k slots, R = T·K routed rows (one per (token, slot)), E experts (held,
stacked), D hidden, BR slots per step, BB buckets (E + 2) padded to a power of two, BD columns per
program.

`route_layout_kernel` turns the routing [T, K] into what the grouped expert kernels read
(`fp4_experts.grouped_gate_up` / `grouped_down` with row indices): a stable counting sort of the
R flat slots t·K + k by stack index, so rows of one expert keep slot order, exactly the order of
`torch.sort(local.reshape(-1), stable=True)` (`quantized.layout_by_expert`). One program:
1. bucket of every slot: its stack index, read through the held table (global expert id -> stack
   index) when one is given; E ("no expert", after every expert) for a slot whose `slot_mask` is False;
2. pass 1 over the slots, BR at a time: per-bucket counts (`tl.histogram`); their exclusive prefix
   sum is each bucket's first row, and expert_offsets;
3. pass 2, per step: the step's slots sorted by the unique key (bucket, slot) (`tl.sort` of BR keys),
   so the i-th of them goes to row = its bucket's running start + i - the step's rows of smaller
   buckets; rows get the token, the flat slot and the route weight in fp32. Per-bucket vectors are
   1-D [BB] and read by gathers (no [BR, BB] one-hot), so a step stays in registers.
The two passes are `route_layout_rows`, the layout's one implementation: `_route_layout_kernel` runs it
in its one program, and `gate.gate_with_layout` in the gate's last program (ids and route weights never
leave the gate's launch before the layout is built; the reads go to L2, ".cg", since other programs of
that launch wrote them).
Everything stays on the device and the launch is sized from host integers (R, E), so a decode step
that uses it can be captured in a CUDA graph. The loop over R is sequential in one program: above
`KERNEL_MAX_ROWS` (341 tokens of top-6) the torch composition builds the same layout.

`sum_slots_kernel` [T, K, D] -> [T, D] (what `moe_layout.sum_slots_in_order` runs on CUDA; the layer loops
leave it to hc_post's launch, which calls the same `sum_slot_row`, `mhc_streams._hc_post_kernel`) adds slot
0, then 1, ... with the result rounded to the slot dtype after every addition, as
`moe_layout.sum_slots_in_order_torch` does (`total += slot` in bf16: the fp32 sum of the two bf16
values rounded to nearest even, here by integer operations, which the interpreter runs exactly too),
so the two are bit-identical.

References next to each kernel: `route_layout_torch`, `moe_layout.sum_slots_in_order_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dependent_launch import dependent_launch, wait_for_inputs

KERNEL_MAX_ROWS = 2048  # routed rows up to which `route_layout` runs the one-program kernel
MAX_BLOCK_ROWS = 256  # slots per step of the kernel's loops (one step up to 42 tokens of top-6)
SUM_BLOCK_COLUMNS = 512  # columns per program of the slot sum
SUM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class RouteLayout:
    """Routed rows sorted by expert (stable: rows of one expert in flat slot order).

    `row_token_ids` [R] int32: the token each row reads (row of x [T, D]).
    `row_slot_ids` [R] int32: the flat slot t·K + k each row came from (its output row).
    `row_weights` [R] fp32: each row's route weight.
    `expert_offsets` [E+1] int32: rows `expert_offsets[e] : expert_offsets[e+1]` go to expert e;
      rows from `expert_offsets[E]` to R are the slots without an expert (slot_mask False), in slot order.
    """

    row_token_ids: torch.Tensor
    row_slot_ids: torch.Tensor
    row_weights: torch.Tensor
    expert_offsets: torch.Tensor


def route_layout(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, *,
                 stack_table: torch.Tensor | None = None, slot_mask: torch.Tensor | None = None) -> RouteLayout:
    """The layout of the routing `ids` [T, K]: the kernel up to `KERNEL_MAX_ROWS` rows, torch above
    (and where `MOEMESH_TORCH_GLUE` forces the torch glue: the same layout)."""
    from moemesh.common.kernels.glue import torch_glue_forced

    if ids.numel() <= KERNEL_MAX_ROWS and not torch_glue_forced():
        return route_layout_kernel(ids, weights, num_experts, stack_table=stack_table, slot_mask=slot_mask)
    return route_layout_torch(ids, weights, num_experts, stack_table=stack_table, slot_mask=slot_mask)


def route_layout_torch(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, *,
                       stack_table: torch.Tensor | None = None,
                       slot_mask: torch.Tensor | None = None) -> RouteLayout:
    """Reference of `route_layout_kernel`: a stable sort of the slots by stack index (E: no expert)."""
    top_k = ids.shape[1]
    stack_index = stack_table[ids] if stack_table is not None else ids.long()  # [T, K]
    if slot_mask is not None:
        stack_index = torch.where(slot_mask, stack_index, num_experts)
    sorted_index, order = torch.sort(stack_index.reshape(-1), stable=True)  # [R] each
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=sorted_index.dtype)  # [E+1]
    return RouteLayout(
        row_token_ids=(order // top_k).to(torch.int32),
        row_slot_ids=order.to(torch.int32),
        row_weights=weights.reshape(-1)[order].float(),
        expert_offsets=torch.searchsorted(sorted_index, bounds).to(torch.int32),  # rows < e before e
    )


@triton.jit
def _slot_buckets(ids_ptr, mask_ptr, table_ptr, slots, num_slots, num_experts, top_k,
                  stride_it, stride_ik, stride_mt, stride_mk, HAS_TABLE: tl.constexpr, HAS_MASK: tl.constexpr):
    """Bucket of flat slots [BR]: the stack index; E for a slot without an expert (masked); E + 1 past
    the last slot. Ids and mask are read from L2 (".cg"): in the gate's launch other programs wrote them."""
    valid = slots < num_slots
    tokens = slots // top_k  # [BR]
    ranks = slots % top_k  # [BR]
    kept = valid
    if HAS_MASK:
        selected = tl.load(mask_ptr + tokens * stride_mt + ranks * stride_mk, mask=valid, other=0, cache_modifier=".cg")
        kept = kept & (selected != 0)
    index = tl.load(ids_ptr + tokens * stride_it + ranks * stride_ik, mask=kept, other=0, cache_modifier=".cg")
    if HAS_TABLE:
        index = tl.load(table_ptr + index, mask=kept, other=0)
    return tl.where(kept, index.to(tl.int32), tl.where(valid, num_experts, num_experts + 1))


@triton.jit
def route_layout_rows(ids_ptr, weights_ptr, mask_ptr, table_ptr, offsets_ptr, row_token_ptr, row_slot_ptr,
                      row_weight_ptr, num_slots, top_k, num_experts, stride_it, stride_ik, stride_wt, stride_wk,
                      stride_mt, stride_mk, HAS_TABLE: tl.constexpr, HAS_MASK: tl.constexpr,
                      NUM_STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """The counting sort of the R flat slots by bucket, in the calling program (the module doc's passes 1
    and 2): the layout's one implementation, run by `_route_layout_kernel` and by the gate's last program
    (`gate.gate_with_layout`)."""
    lanes = tl.arange(0, BLOCK_R)  # [BR]
    buckets = tl.arange(0, BLOCK_B)  # [BB] experts, then "no expert", then past the last slot
    counts = tl.zeros([BLOCK_B], dtype=tl.int32)  # rows per bucket
    for step in range(0, NUM_STEPS):
        bucket = _slot_buckets(ids_ptr, mask_ptr, table_ptr, step * BLOCK_R + lanes, num_slots, num_experts, top_k,
                               stride_it, stride_ik, stride_mt, stride_mk, HAS_TABLE, HAS_MASK)  # [BR]
        counts += tl.histogram(bucket, BLOCK_B)
    starts = tl.cumsum(counts, 0) - counts  # [BB] first row of each bucket
    tl.store(offsets_ptr + buckets, starts, mask=buckets <= num_experts)  # offsets[E]: rows with an expert

    for step in range(0, NUM_STEPS):
        bucket = _slot_buckets(ids_ptr, mask_ptr, table_ptr, step * BLOCK_R + lanes, num_slots, num_experts, top_k,
                               stride_it, stride_ik, stride_mt, stride_mk, HAS_TABLE, HAS_MASK)  # [BR]
        step_counts = tl.histogram(bucket, BLOCK_B)  # [BB]
        step_starts = tl.cumsum(step_counts, 0) - step_counts  # [BB] first place of each bucket in this step
        ordered = tl.sort(bucket * BLOCK_R + lanes)  # [BR] this step's slots by (bucket, slot): unique keys
        ordered_bucket = ordered // BLOCK_R
        slots = step * BLOCK_R + ordered % BLOCK_R  # [BR]
        rows = tl.gather(starts, ordered_bucket, 0) + lanes - tl.gather(step_starts, ordered_bucket, 0)  # [BR]
        valid = ordered_bucket <= num_experts
        tokens = slots // top_k
        ranks = slots % top_k
        weight = tl.load(weights_ptr + tokens * stride_wt + ranks * stride_wk, mask=valid, other=0.0,
                         cache_modifier=".cg")
        tl.store(row_token_ptr + rows, tokens, mask=valid)
        tl.store(row_slot_ptr + rows, slots, mask=valid)
        tl.store(row_weight_ptr + rows, weight.to(tl.float32), mask=valid)
        starts += step_counts


@triton.jit
def _route_layout_kernel(
    ids_ptr, weights_ptr, mask_ptr, table_ptr, offsets_ptr, row_token_ptr, row_slot_ptr, row_weight_ptr,
    num_slots, top_k, num_experts, stride_it, stride_ik, stride_wt, stride_wk, stride_mt, stride_mk,
    HAS_TABLE: tl.constexpr, HAS_MASK: tl.constexpr, NUM_STEPS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    wait_for_inputs(USE_PDL)
    route_layout_rows(ids_ptr, weights_ptr, mask_ptr, table_ptr, offsets_ptr, row_token_ptr, row_slot_ptr,
                      row_weight_ptr, num_slots, top_k, num_experts, stride_it, stride_ik, stride_wt, stride_wk,
                      stride_mt, stride_mk, HAS_TABLE, HAS_MASK, NUM_STEPS, BLOCK_R, BLOCK_B)


def empty_layout(num_slots: int, num_experts: int, device: torch.device) -> RouteLayout:
    """Uninitialised layout tensors for R slots over E experts (what a launch fills)."""
    return RouteLayout(
        row_token_ids=torch.empty(num_slots, dtype=torch.int32, device=device),
        row_slot_ids=torch.empty(num_slots, dtype=torch.int32, device=device),
        row_weights=torch.empty(num_slots, dtype=torch.float32, device=device),
        expert_offsets=torch.empty(num_experts + 1, dtype=torch.int32, device=device),
    )


def route_layout_kernel(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, *,
                        stack_table: torch.Tensor | None = None,
                        slot_mask: torch.Tensor | None = None) -> RouteLayout:
    """ids [T, K] (global expert ids read through `stack_table` [num routed] int, else stack indices),
    weights [T, K], slot_mask [T, K] bool or None -> `RouteLayout`, one launch, no host sync.

    Selected slots must name a held expert (stack index in [0, E)); masked slots are not read through
    the table."""
    num_tokens, top_k = ids.shape
    num_slots = num_tokens * top_k
    layout = empty_layout(num_slots, num_experts, ids.device)
    if num_slots == 0:
        layout.expert_offsets.zero_()
        return layout
    mask = slot_mask.view(torch.uint8) if slot_mask is not None else ids  # never read without a mask
    block_rows = min(triton.next_power_of_2(num_slots), MAX_BLOCK_ROWS)
    _route_layout_kernel[(1,)](
        ids, weights, mask, stack_table if stack_table is not None else ids,
        layout.expert_offsets, layout.row_token_ids, layout.row_slot_ids, layout.row_weights,
        num_slots, top_k, num_experts, ids.stride(0), ids.stride(1), weights.stride(0), weights.stride(1),
        mask.stride(0), mask.stride(1),
        HAS_TABLE=stack_table is not None, HAS_MASK=slot_mask is not None,
        NUM_STEPS=triton.cdiv(num_slots, block_rows), BLOCK_R=block_rows,
        BLOCK_B=triton.next_power_of_2(num_experts + 2), num_warps=4 if block_rows <= 128 else 8,
        **dependent_launch(ids.device),
    )
    return layout


# ----------------------------------------------------------------------------------- slot sum
@triton.jit
def _round_to_bf16(x):
    """fp32 -> bf16 rounded to nearest, ties to even (NaN -> 0x7FC0), by integer operations: torch's
    rounding on every backend (the interpreter's own fp32 -> bf16 cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def sum_slot_row(slot_row_ptr, stride_sk, in_row, TOP_K: tl.constexpr, IS_BF16: tl.constexpr):
    """One token's K slot rows over [BD] columns (slot_row_ptr: slot 0's, slot k at + k·stride_sk) -> their
    sum [BD] in the slot dtype: slot 0 + slot 1 + ..., rounded to the dtype after every addition
    (`moe_layout.sum_slots_in_order_torch`). The slot sum's one implementation: `_sum_slots_kernel` and
    `mhc_streams._hc_post_kernel` (routed slots summed inside hc_post) both call it."""
    total = tl.load(slot_row_ptr, mask=in_row, other=0.0)  # [BD] slot 0, in the slot dtype
    for slot in tl.static_range(1, TOP_K):
        addend = tl.load(slot_row_ptr + slot * stride_sk, mask=in_row, other=0.0)  # [BD]
        total_fp32 = total.to(tl.float32) + addend.to(tl.float32)  # then rounded once to the slot dtype
        if IS_BF16:
            total = _round_to_bf16(total_fp32)
        else:
            total = total_fp32.to(addend.dtype)
    return total


@triton.jit
def _sum_slots_kernel(slots_ptr, out_ptr, hidden_size, stride_st, stride_sk, stride_ot,
                      TOP_K: tl.constexpr, IS_BF16: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    in_row = columns < hidden_size
    total = sum_slot_row(slots_ptr + token * stride_st + columns, stride_sk, in_row, TOP_K, IS_BF16)  # [BD]
    tl.store(out_ptr + token * stride_ot + columns, total, mask=in_row)


def sum_slots_kernel(slot_outputs: torch.Tensor) -> torch.Tensor:
    """[T, K, D] (bf16, fp16 or fp32, columns contiguous) -> [T, D]: slot 0 + slot 1 + ... in order,
    rounded to the dtype after each addition; one launch."""
    num_tokens, top_k, hidden_size = slot_outputs.shape
    if slot_outputs.dtype not in SUM_DTYPES or slot_outputs.stride(2) != 1 or top_k == 0:
        raise ValueError(f"slot sum of {slot_outputs.dtype} [T, K, D] strides {slot_outputs.stride()}, K={top_k}")
    out = torch.empty(num_tokens, hidden_size, dtype=slot_outputs.dtype, device=slot_outputs.device)
    if num_tokens == 0 or hidden_size == 0:
        return out
    grid = (num_tokens, triton.cdiv(hidden_size, SUM_BLOCK_COLUMNS))
    _sum_slots_kernel[grid](slot_outputs, out, hidden_size, slot_outputs.stride(0), slot_outputs.stride(1),
                            out.stride(0), TOP_K=top_k, IS_BF16=slot_outputs.dtype == torch.bfloat16,
                            BLOCK_D=SUM_BLOCK_COLUMNS, num_warps=4, **dependent_launch(out.device))
    return out
