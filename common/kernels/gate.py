"""The MoE gate (docs/model.md §2.8) in one launch: scores, top-k or hash ids, normalised weights.

Legend: T tokens, D hidden, E routed experts, EP E padded to a power of two, K experts per token
(KP padded), S splits of D, BT/BE/BD rows/experts/columns per program step, RB row blocks.

The reference is `common/model/moe.py: Gate` (its torch code is the CPU path). Per token row, with
the one score function the model accepts (`scoring_func = "sqrtsoftplus"`, config.py rejects others):
    logits = x · Wᵀ (fp32 sum, rounded to x's dtype), s = sqrt(softplus(logits)) (each step rounded
    to x's dtype as torch does), learned layers: ids = top-K of s + bias (fp32), hash layers:
    ids = tid2eid[token]; ids ascending; w = s[ids]; w = scale · w / (Σ w + 1e-20), the sum, the
    division and the product each rounded to x's dtype.

Design (grid [RB, E/BE · S], one launch, no host read: capturable in a CUDA graph):
- every program computes the fp32 logits of BT rows × BE experts over one D slice (D_STEPS · BD
  columns) and reads its W tile once; one row (T ≤ FMA_MAX_TOKENS) uses fp32 multiply-adds and a
  reduction over BD, more rows `tl.dot` on rows padded to 16 (bf16 products are exact; fp32 inputs
  use "ieee");
- with one program per row block (BE = EP, S = 1) it finishes in registers; otherwise it stores its
  partial [BT, BE] into a workspace [RB, S, BT, EP] and takes a ticket on the row block's counter
  (`split_k.take_ticket`); the last program of the row block sums the S partials in the fixed
  order s = 0..S-1 (deterministic, whatever the arrival order) and finishes the BT rows:
- finish: score function, bias, selection by K rounds of "largest value, lowest expert id among
  equal values" (so the selected set is torch.topk's on CUDA: every value above the K-th, then
  the lowest ids among values equal to it), or a count of each row's table ids (duplicates kept);
  then K rounds of "lowest selected id" give the ids ascending, each with its score by a masked sum;
  normalisation and scale as above; ids are stored int64, weights in x's dtype.
Bytes: W (E·D·itemsize, 2 MiB at V4-Flash bf16) is read once per row block; the floor of a decode
call is W bytes / copy bandwidth (~0.5 µs on an H200); the partials (S·BT·EP·4 bytes per row block)
stay in L2. A decode call is latency-bound: one HBM read wave, the ticket, one program's finish.
The counters are zeroed once per device, at the first call (`split_k.tile_counters`).
`gate_with_layout` (decode sizes, T·K <= 256): every program that finished a row block takes one more ticket
(counter RB, after the row blocks' 0..RB-1); the last of them runs the route layout's counting sort
(`route_layout.route_layout_rows`) over all T·K ids through the holder's stack table, so the in-process
experts skip their `route_layout` launch; the layout tensors are bit for bit `route_layout`'s.

Numerics: ids equal the reference's whenever the logits are equal; the fp32 sum runs in another order
than cuBLAS / the CPU GEMM, so a logit can differ by one rounding of x's dtype in rare cases, which
can only change ids where two biased scores at the K-th place are within that rounding. Softplus
uses libdevice expf / log1pf and IEEE sqrt and division (`sqrt_rn`, `div_rn`), the functions torch's
CUDA kernels call, so from equal logits the bf16 scores and weights are bit-equal to torch on CUDA;
fp32 weights differ by summation order only (tested within 1e-5 relative, seen ≤ 4e-7). Under
TRITON_INTERPRET=1 the libdevice calls are replaced by `tl.exp` / `tl.log` with an accurate log1p
(the interpreter has no libdevice).
NaN scores give undefined ids (torch.topk ranks NaN first; the kernel never selects it).
The fp32 sum order depends on the launch configuration, which is chosen from T.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dependent_launch import (
    dependent_launch, prefetch_rows_to_l2, wait_for_inputs, weight_rows_prefetchable,
)
from moemesh.common.kernels.route_layout import MAX_BLOCK_ROWS, RouteLayout, empty_layout, route_layout_rows
from moemesh.common.kernels.split_k import take_ticket, tile_counters

FMA_MAX_TOKENS = 1  # up to this many rows: multiply-add GEMV; above: tl.dot (rows padded to 16)
FMA_TILE_ELEMENTS = 8192  # BT · BE · BD products per GEMV step
TARGET_PROGRAMS = 128  # about one program per SM on an H200 for decode
MIN_D_PER_SPLIT = 256
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's default: softplus(z) = z above it
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def _log1p_exp(z):
        """log(1 + exp(z)) in fp32; log1p(u) = log(1 + u) · u / ((1 + u) − 1) keeps small u accurate."""
        u = tl.exp(z)
        v = 1.0 + u
        return tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _log1p_exp(z):
        """log1pf(expf(z)): what torch's CUDA softplus computes in fp32."""
        return libdevice.log1p(libdevice.exp(z))


@triton.jit
def _round(x, ROUND_BF16: tl.constexpr):
    """fp32 -> the nearest bf16 (ties to even), kept as fp32; identity for fp32 outputs."""
    if ROUND_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _logits_block(x_ptr, w_ptr, rows, row_mask, experts, expert_mask, d_start, hidden,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr,
                  USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 Σ_d x[rows, d] · W[experts, d] over d in [d_start, d_start + D_STEPS · BD) -> [BT, BE]."""
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_D)
    for step in range(0, D_STEPS):
        d = d_start + step * BLOCK_D + cols  # [BD]
        d_mask = d < hidden
        x = tl.load(x_ptr + rows[:, None] * hidden + d[None, :], mask=row_mask[:, None] & d_mask[None, :],
                    other=0.0)  # [BT, BD]
        if USE_DOT:
            w = tl.load(w_ptr + experts[None, :] * hidden + d[:, None], mask=expert_mask[None, :] & d_mask[:, None],
                        other=0.0)  # [BD, BE]
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        else:
            w = tl.load(w_ptr + experts[:, None] * hidden + d[None, :], mask=expert_mask[:, None] & d_mask[None, :],
                        other=0.0)  # [BE, BD]
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _finish_rows(logits, rows, row_mask, bias_ptr, tid2eid_ptr, token_ids_ptr, ids_ptr, weights_ptr,
                 num_experts, route_scale, TOP_K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                 HASH: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """logits [BT, EP] fp32 -> ids [BT, K] int64 ascending and weights [BT, K] stored."""
    experts = tl.arange(0, EP)
    expert_mask = experts < num_experts
    z = _round(logits, ROUND_BF16)
    softplus = _round(tl.where(z > SOFTPLUS_THRESHOLD, z, _log1p_exp(z)), ROUND_BF16)
    scores = _round(tl.sqrt_rn(softplus), ROUND_BF16)  # [BT, EP]
    count = tl.zeros(logits.shape, dtype=tl.int32)  # how often each expert is selected per row
    if HASH:
        token = tl.load(token_ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        for k in tl.static_range(TOP_K):
            table_id = tl.load(tid2eid_ptr + token * TOP_K + k, mask=row_mask, other=0).to(tl.int32)  # [BT]
            count += (experts[None, :] == table_id[:, None]).to(tl.int32)
    else:
        biased = scores
        if HAS_BIAS:
            biased += tl.load(bias_ptr + experts, mask=expert_mask, other=0.0)[None, :]
        biased = tl.where(expert_mask[None, :], biased, float("-inf"))
        for _ in tl.static_range(TOP_K):
            best = tl.max(biased, axis=1)  # [BT]
            pick = tl.min(tl.where(biased == best[:, None], experts[None, :], EP), axis=1)  # lowest id among ties
            hit = experts[None, :] == pick[:, None]
            count += hit.to(tl.int32)
            biased = tl.where(hit, float("-inf"), biased)
    slots = tl.arange(0, KP)
    ids = tl.zeros([logits.shape[0], KP], dtype=tl.int32)
    weights = tl.zeros([logits.shape[0], KP], dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # ascending ids, duplicates (hash tables) kept
        expert = tl.min(tl.where(count > 0, experts[None, :], EP), axis=1)  # [BT]
        hit = experts[None, :] == expert[:, None]
        weight = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        count -= hit.to(tl.int32)
        ids = tl.where(slots[None, :] == k, expert[:, None], ids)
        weights = tl.where(slots[None, :] == k, weight[:, None], weights)
    total = _round(tl.sum(weights, axis=1), ROUND_BF16)
    total = _round(total + 1e-20, ROUND_BF16)
    weights = _round(tl.div_rn(weights, total[:, None]), ROUND_BF16)
    weights = _round(weights * route_scale, ROUND_BF16)
    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_mask)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _layout_after_last_row_block(ids_ptr, weights_ptr, table_ptr, offsets_ptr, row_token_ptr, row_slot_ptr,
                                 row_weight_ptr, counter_ptr, num_tokens, num_held, TOP_K: tl.constexpr,
                                 HAS_TABLE: tl.constexpr, NUM_STEPS: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_B: tl.constexpr):
    """Called by the program that finished a row block (its ids and weights stored): the last of the RB such
    programs (ticket on counter RB, after the row blocks' own) runs the route layout over all T·K ids."""
    num_row_blocks = tl.num_programs(0)
    if take_ticket(counter_ptr + num_row_blocks, num_row_blocks):
        route_layout_rows(ids_ptr, weights_ptr, ids_ptr, table_ptr, offsets_ptr, row_token_ptr, row_slot_ptr,
                          row_weight_ptr, num_tokens * TOP_K, TOP_K, num_held, TOP_K, 1, TOP_K, 1, 0, 0,
                          HAS_TABLE, False, NUM_STEPS, BLOCK_R, BLOCK_B)


@triton.jit
def _gate_kernel(x_ptr, w_ptr, bias_ptr, tid2eid_ptr, token_ids_ptr, ids_ptr, weights_ptr, partial_ptr, counter_ptr,
                 num_tokens, hidden, num_experts, route_scale,
                 TOP_K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, HASH: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr, NUM_E_BLOCKS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 USE_DOT: tl.constexpr, PRECISION: tl.constexpr, table_ptr=None, offsets_ptr=None, row_token_ptr=None,
                 row_slot_ptr=None, row_weight_ptr=None, num_held=0, LAYOUT_STEPS: tl.constexpr = 0,
                 LAYOUT_BLOCK_R: tl.constexpr = 1, LAYOUT_BLOCK_B: tl.constexpr = 1, HAS_TABLE: tl.constexpr = False,
                 USE_PDL: tl.constexpr = False, PREFETCH_L2: tl.constexpr = False):
    # x [T, D], W [E, D] (same dtype), bias [E] fp32, tid2eid [V, K], token_ids [T] -> ids [T, K], weights [T, K];
    # with LAYOUT_STEPS, also the route layout of all T·K ids (stack index through table [E] when HAS_TABLE,
    # over num_held experts): offsets [num_held + 1], row_token / row_slot / row_weight [T·K]
    row_block = tl.program_id(0)
    e_block = tl.program_id(1) % NUM_E_BLOCKS
    split = tl.program_id(1) // NUM_E_BLOCKS
    experts = e_block * BLOCK_E + tl.arange(0, BLOCK_E)
    if PREFETCH_L2:  # this program's gate rows towards L2 while the previous kernel drains (first row block)
        ELEMENT_BYTES: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
        d_first = split * D_STEPS * BLOCK_D
        span = tl.minimum(D_STEPS * BLOCK_D, hidden - d_first)  # elements per row
        prefetch_rows_to_l2(w_ptr + experts.to(tl.int64) * hidden + d_first, span * ELEMENT_BYTES + experts * 0,
                            (experts < num_experts) & (row_block == 0) & (span > 0))
    wait_for_inputs(USE_PDL)
    rows = row_block * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    acc = _logits_block(x_ptr, w_ptr, rows.to(tl.int64), row_mask, experts.to(tl.int64), experts < num_experts,
                        split * D_STEPS * BLOCK_D, hidden, BLOCK_T, BLOCK_E, BLOCK_D, D_STEPS, USE_DOT, PRECISION)
    if NUM_E_BLOCKS * NUM_SPLITS == 1:
        _finish_rows(acc, rows, row_mask, bias_ptr, tid2eid_ptr, token_ids_ptr, ids_ptr, weights_ptr, num_experts,
                     route_scale, TOP_K, KP, EP, HASH, HAS_BIAS, ROUND_BF16)
        if LAYOUT_STEPS:
            _layout_after_last_row_block(ids_ptr, weights_ptr, table_ptr, offsets_ptr, row_token_ptr, row_slot_ptr,
                                         row_weight_ptr, counter_ptr, num_tokens, num_held, TOP_K, HAS_TABLE,
                                         LAYOUT_STEPS, LAYOUT_BLOCK_R, LAYOUT_BLOCK_B)
    else:
        block_rows = tl.arange(0, BLOCK_T)
        part_base = partial_ptr + row_block.to(tl.int64) * NUM_SPLITS * BLOCK_T * EP  # [S, BT, EP] of this row block
        tl.store(part_base + split * BLOCK_T * EP + block_rows[:, None] * EP + experts[None, :], acc)
        if take_ticket(counter_ptr + row_block, NUM_E_BLOCKS * NUM_SPLITS):
            all_experts = tl.arange(0, EP)
            logits = tl.zeros([BLOCK_T, EP], dtype=tl.float32)
            for s in tl.static_range(NUM_SPLITS):  # fixed order: deterministic sum
                logits += tl.load(part_base + s * BLOCK_T * EP + block_rows[:, None] * EP + all_experts[None, :],
                                  cache_modifier=".cg")
            _finish_rows(logits, rows, row_mask, bias_ptr, tid2eid_ptr, token_ids_ptr, ids_ptr, weights_ptr,
                         num_experts, route_scale, TOP_K, KP, EP, HASH, HAS_BIAS, ROUND_BF16)
            if LAYOUT_STEPS:
                _layout_after_last_row_block(ids_ptr, weights_ptr, table_ptr, offsets_ptr, row_token_ptr,
                                             row_slot_ptr, row_weight_ptr, counter_ptr, num_tokens, num_held, TOP_K,
                                             HAS_TABLE, LAYOUT_STEPS, LAYOUT_BLOCK_R, LAYOUT_BLOCK_B)


@dataclass(frozen=True)
class GateConfig:
    """Launch shape. block_t < 16: multiply-add GEMV; block_t >= 16: tl.dot (block_e, block_d >= 16).

    block_e must divide the padded expert count; num_splits cuts D into equal multiples of block_d.
    """

    block_t: int
    block_e: int
    block_d: int
    num_splits: int = 1
    num_warps: int = 4

    @property
    def use_dot(self) -> bool:
        return self.block_t >= 16


def padded_experts(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


def choose_config(num_tokens: int, num_experts: int, hidden: int) -> GateConfig:
    """About TARGET_PROGRAMS programs over row blocks × expert blocks × D slices; above 256 rows
    each program covers all experts (no expert split), above ~4K rows no D split either."""
    padded = padded_experts(num_experts)
    if num_tokens <= FMA_MAX_TOKENS:
        block_t = triton.next_power_of_2(max(num_tokens, 1))
        block_e = min(padded, 16)
        e_blocks = padded // block_e
        splits = max(1, min(TARGET_PROGRAMS // e_blocks, hidden // MIN_D_PER_SPLIT))
        block_d = min(triton.next_power_of_2(hidden), max(32, FMA_TILE_ELEMENTS // (block_t * block_e)))
        return GateConfig(block_t, block_e, block_d, splits)
    block_t, block_e, block_d = (16, min(padded, 64), 64) if num_tokens <= 256 else (32, padded, 32)
    programs = triton.cdiv(num_tokens, block_t) * (padded // block_e)
    splits = max(1, min(TARGET_PROGRAMS // programs, hidden // MIN_D_PER_SPLIT))
    return GateConfig(block_t, block_e, block_d, splits, num_warps=8)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Dtypes the kernel reproduces (the model's: fp32 on CPU, bf16 on GPUs)."""
    return x.dtype in SUPPORTED_DTYPES and weight.dtype == x.dtype and x.dim() == 2


def gate(x: torch.Tensor, weight: torch.Tensor, *, top_k: int, route_scale: float,
         bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
         token_ids: torch.Tensor | None = None, config: GateConfig | None = None,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], weight [E, D] -> ids [T, K] int64 ascending, weights [T, K] (x's dtype), as `Gate`.

    Hash routing when tid2eid [V, K] (with token_ids [T]) is given, else top-K of s (+ bias [E] fp32).
    """
    return _launch(x, weight, top_k=top_k, route_scale=route_scale, bias=bias, tid2eid=tid2eid,
                   token_ids=token_ids, config=config)[:2]


def fuses_layout(num_tokens: int, top_k: int) -> bool:
    """Whether `gate_with_layout` builds the layout in the gate's launch: decode sizes, T·K slots in one step
    of the layout's loops."""
    return 0 < num_tokens * top_k <= MAX_BLOCK_ROWS


def gate_with_layout(x: torch.Tensor, weight: torch.Tensor, *, top_k: int, route_scale: float, num_held: int,
                     stack_table: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                     config: GateConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, RouteLayout]:
    """`gate`, plus the route layout of its ids over num_held stacked experts (`route_layout.route_layout(ids,
    weights, num_held, stack_table=stack_table)`, the same tensors bit for bit) in the same launch: the last
    program to finish its row block runs the layout's counting sort. Every id must be held (stack_table
    [E] int maps global id -> stack index). Only at `fuses_layout` sizes (ValueError above)."""
    num_tokens = x.shape[0]
    if not fuses_layout(num_tokens, top_k):
        raise ValueError(f"{num_tokens} tokens of top-{top_k}: above the fused layout's {MAX_BLOCK_ROWS} slots")
    return _launch(x, weight, top_k=top_k, route_scale=route_scale, bias=bias, tid2eid=tid2eid,
                   token_ids=token_ids, config=config, layout_experts=num_held, stack_table=stack_table)


def _launch(x: torch.Tensor, weight: torch.Tensor, *, top_k: int, route_scale: float, bias: torch.Tensor | None,
            tid2eid: torch.Tensor | None, token_ids: torch.Tensor | None, config: GateConfig | None,
            layout_experts: int | None = None, stack_table: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, RouteLayout | None]:
    """The gate's one launch -> (ids [T, K], weights [T, K], layout or None); layout_experts: also the route
    layout over that many held experts (stack_table [E] or None)."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if not supports(x, weight) or weight.shape[1] != hidden:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} do not fit")
    hashed = tid2eid is not None
    if hashed and (token_ids is None or tid2eid.shape[1] != top_k):
        raise ValueError("hash routing needs token_ids and a tid2eid table of K columns")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} outside 1..{num_experts}")
    x, weight = x.contiguous(), weight.contiguous()
    ids = torch.empty(num_tokens, top_k, dtype=torch.long, device=x.device)
    weights = torch.empty(num_tokens, top_k, dtype=x.dtype, device=x.device)
    with_layout = layout_experts is not None
    layout = empty_layout(num_tokens * top_k, layout_experts, x.device) if with_layout else None
    if num_tokens == 0:
        if with_layout:
            layout.expert_offsets.zero_()
        return ids, weights, layout
    config = config or choose_config(num_tokens, num_experts, hidden)
    padded = padded_experts(num_experts)
    if padded % config.block_e:
        raise ValueError(f"block_e {config.block_e} does not divide {padded}")
    e_blocks = padded // config.block_e
    d_steps = triton.cdiv(triton.cdiv(hidden, config.num_splits), config.block_d)  # per split
    row_blocks = triton.cdiv(num_tokens, config.block_t)
    split = e_blocks * config.num_splits > 1
    partials = (torch.empty(row_blocks * config.num_splits * config.block_t * padded, dtype=torch.float32,
                            device=x.device) if split else weights)
    # row block b's ticket at counter b; with the layout, the layout's at counter RB
    counters = tile_counters(x.device, row_blocks + with_layout) if split or with_layout else ids
    layout_args = {}
    if with_layout:
        num_slots = num_tokens * top_k
        layout_args = dict(
            table_ptr=stack_table.contiguous() if stack_table is not None else ids, offsets_ptr=layout.expert_offsets,
            row_token_ptr=layout.row_token_ids, row_slot_ptr=layout.row_slot_ids, row_weight_ptr=layout.row_weights,
            num_held=layout_experts, LAYOUT_STEPS=1, LAYOUT_BLOCK_R=triton.next_power_of_2(num_slots),
            LAYOUT_BLOCK_B=triton.next_power_of_2(layout_experts + 2), HAS_TABLE=stack_table is not None)
    _gate_kernel[(row_blocks, e_blocks * config.num_splits)](
        x, weight, bias.contiguous() if bias is not None else weights,
        tid2eid.contiguous() if hashed else ids, token_ids.contiguous() if hashed else ids,
        ids, weights, partials, counters, num_tokens, hidden, num_experts, float(route_scale),
        TOP_K=top_k, KP=triton.next_power_of_2(top_k), EP=padded, HASH=hashed, HAS_BIAS=bias is not None and not hashed,
        ROUND_BF16=x.dtype == torch.bfloat16, BLOCK_T=config.block_t, BLOCK_E=config.block_e, BLOCK_D=config.block_d,
        D_STEPS=d_steps, NUM_E_BLOCKS=e_blocks, NUM_SPLITS=config.num_splits, USE_DOT=config.use_dot,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=config.num_warps, **layout_args,
        **dependent_launch(x.device), PREFETCH_L2=weight.is_contiguous() and weight_rows_prefetchable(
            x.device, (weight,), hidden * weight.element_size(), d_steps * config.block_d * weight.element_size()))
    return ids, weights, layout
