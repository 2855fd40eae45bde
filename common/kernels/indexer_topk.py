"""Lightning-indexer scores and top-k of every token of a forward: one launch at decode sizes (docs/model.md §2.6).

score[t, w] = Σ_h weight[t, h] · ReLU(q[t, h] · k_w) · d^-1/2 for rows w < (p+1)//m visible at t's
position p, -inf elsewhere (rows of other tokens' sequences differ: each token reads its own
sequence's indexer rows through the address tables of `common.kernels.attention_layout`).
One program covers (token, a few consecutive blocks of rows) with all heads at once: per block one
[H, d] x [d, BN] dot, ReLU, the weighted sum over heads (blocks past the token's visible rows are
written -inf without loads: half of them in a causal prefill). FP8 indexer rows (`tables.indexer_rows`: e4m3
codes and one fp32 scale per row, common/model/kv_layouts.py) are dequantized in registers, code × scale in
fp32, then cast to the queries' dtype (exact: the scale is a power of two), so the dot is the one plain rows
holding those values get. Then K rows per token are picked; only
tokens that see more than K rows use them, and for those every pick is visible (more than K finite
scores, invisible ones are -inf). Tokens that see at most K rows attend to all of them, so when no
token of the forward sees more than K rows the indexer is skipped altogether.

The pick (`top_k_columns`): at decode sizes (at most TOPK_KERNEL_MAX_TOKENS tokens) one program per token
finds the K-th largest score by a radix select over the scores' order-preserving 32-bit keys (four
passes of an 8-bit digit histogram, the scores read once when they fit one block), then writes the
columns of the larger scores and as many of the equal ones as K needs, lowest columns first, in
ascending column order (torch.topk's one-block select: ~15 µs for 1K columns on an H100).
torch.topk picks for larger forwards. Both select the same set up to which columns of
scores equal to the K-th are taken; the keys order floats as torch's radix select does (-0.0 below
+0.0, NaN above every number).

`indexer_topk`, what the attention calls: at decode sizes scores and pick run in one launch
(`indexer_scores_top_k`): each score program stores its blocks of the scores row, then takes a ticket on
its token's counter (`split_k.take_ticket`: counters 0..T-1 of the device's shared buffer, which the last
program puts back to 0; G, the token's number of score programs, is a runtime value); the program that
arrives last runs the token's radix select (`_select_top_k`, the code `top_k_columns` launches) over the
whole row. Same scores, same columns in the same order as the two launches, bit for bit. The grid and
every argument come from host figures of the tables (N = `max_rows_visible`: the static row class of a
captured decode step), so the launch is CUDA-graph capturable. Larger forwards: the scores launch, then
torch.topk.
Legend: T tokens, H indexer heads, d indexer head dim, N = most visible rows of any token, BN rows
per block, G score programs per token, K top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.attention_layout import (
    CONTIGUOUS_ROWS_PER_BLOCK, NUM_FIELDS, AttentionTables, Field, check_indexer_row_layout,
)
from moemesh.common.kernels.dependent_launch import dependent_launch, wait_for_inputs
from moemesh.common.kernels.split_k import take_ticket, tile_counters


@triton.jit
def _fp8_indexer_keys(addr, valid, dims, HEAD_DIM: tl.constexpr, KEY_DTYPE: tl.constexpr):
    """Keys [BN, d] in KEY_DTYPE from the FP8 indexer rows at byte addresses addr [BN] (rows where `valid`):
    e4m3 code × the row's fp32 scale (stored after the codes)."""
    codes = tl.load(addr.to(tl.pointer_type(tl.uint8))[:, None] + dims[None, :], mask=valid[:, None],
                    other=0)  # [BN, d] e4m3 bytes
    scale = tl.load((addr + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)  # [BN]
    return (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]).to(KEY_DTYPE)


@triton.jit
def _score_row_blocks(q_ptr, weights_ptr, scores_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                      num_heads, num_rows_out, block_stride, rows_per_block, row_scale, t, group,
                      RATIO: tl.constexpr, NUM_FIELDS_: tl.constexpr, F_ROWS_ADDR: tl.constexpr,
                      HEAD_DIM: tl.constexpr, ROW_BYTES: tl.constexpr, ROW_ALIGN: tl.constexpr,
                      BLOCK_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
                      IEEE: tl.constexpr, PAGED: tl.constexpr, FP8: tl.constexpr):
    """Scores [BLOCKS_PER_PROGRAM · BN] of token t's row blocks of group `group` into scores [T, N] (-inf past
    the token's visible rows)."""
    b = tl.load(token_seq_ptr + t)
    pos = tl.load(positions_ptr + t)
    n_visible = (pos + 1) // RATIO
    rows_addr = tl.load(fields_ptr + b.to(tl.int64) * NUM_FIELDS_ + F_ROWS_ADDR)
    dims = tl.arange(0, HEAD_DIM)
    for block_index in range(0, BLOCKS_PER_PROGRAM):  # several row blocks per program: q stays in L1
        row_block = group * BLOCKS_PER_PROGRAM + block_index
        rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
        out_mask = rows < num_rows_out
        score_ptrs = scores_ptr + t.to(tl.int64) * num_rows_out + rows
        if row_block * BLOCK_N < n_visible:
            valid = rows < n_visible
            if PAGED:  # 32-bit division (64-bit division is a slow per-element subroutine)
                block = tl.load(block_ids_ptr + b.to(tl.int64) * block_stride + rows // rows_per_block, mask=valid,
                                other=0)
                row_index = block * rows_per_block + rows % rows_per_block
            else:
                row_index = rows.to(tl.int64)
            addr = tl.multiple_of(rows_addr + row_index * ROW_BYTES, ROW_ALIGN)
            if FP8:
                keys = _fp8_indexer_keys(addr, valid, dims, HEAD_DIM, q_ptr.dtype.element_ty)  # [BN, d]
            else:
                row_ptrs = addr.to(tl.pointer_type(q_ptr.dtype.element_ty))
                keys = tl.load(row_ptrs[:, None] + dims[None, :], mask=valid[:, None], other=0.0)  # [BN, d]
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for h0 in range(0, num_heads, BLOCK_HEADS):
                heads = h0 + tl.arange(0, BLOCK_HEADS)
                head_mask = heads < num_heads
                q_rows = t.to(tl.int64) * num_heads + heads
                q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + dims[None, :], mask=head_mask[:, None], other=0.0)
                if IEEE:
                    logits = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BHd, BN]
                else:
                    logits = tl.dot(q, tl.trans(keys))
                weights = tl.load(weights_ptr + q_rows, mask=head_mask, other=0.0)  # fp32
                total += tl.sum(tl.maximum(logits, 0.0) * row_scale * weights[:, None], axis=0)
            tl.store(score_ptrs, tl.where(valid, total, float("-inf")), mask=out_mask)
        else:  # a block past every visible row (causal prefill: half of them)
            tl.store(score_ptrs, tl.full([BLOCK_N], float("-inf"), dtype=tl.float32), mask=out_mask)


@triton.jit
def _indexer_scores_kernel(q_ptr, weights_ptr, scores_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                           num_heads, num_rows_out, block_stride, rows_per_block, row_scale,
                           RATIO: tl.constexpr, NUM_FIELDS_: tl.constexpr, F_ROWS_ADDR: tl.constexpr,
                           HEAD_DIM: tl.constexpr, ROW_BYTES: tl.constexpr, ROW_ALIGN: tl.constexpr,
                           BLOCK_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
                           IEEE: tl.constexpr, PAGED: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    # grid (T, groups of BLOCKS_PER_PROGRAM row blocks) -> scores [T, N] fp32
    _score_row_blocks(q_ptr, weights_ptr, scores_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                      num_heads, num_rows_out, block_stride, rows_per_block, row_scale, tl.program_id(0),
                      tl.program_id(1), RATIO, NUM_FIELDS_, F_ROWS_ADDR, HEAD_DIM, ROW_BYTES, ROW_ALIGN, BLOCK_HEADS,
                      BLOCK_N, BLOCKS_PER_PROGRAM, IEEE, PAGED, FP8)


def _score_launch(queries: torch.Tensor, head_weights: torch.Tensor, tables: AttentionTables, layer: int, *,
                  ratio: int, block_n: int, block_heads: int, blocks_per_program: int | None):
    """What a launch that scores takes, from host figures only (CUDA-graph capturable): (scores [T, N] fp32 it
    writes, grid (T, groups of row blocks), the scores kernel's arguments, its constexprs). N > 0."""
    num_tokens, num_heads, head_dim = queries.shape
    num_rows = tables.max_rows_visible(ratio)
    scores = torch.empty(num_tokens, num_rows, dtype=torch.float32, device=queries.device)  # [T, N]
    queries = queries.contiguous()  # [T, H, d]
    head_weights = head_weights.float().contiguous()  # [T, H]
    block_heads = min(block_heads, triton.next_power_of_2(num_heads))
    num_blocks = triton.cdiv(num_rows, block_n)
    if blocks_per_program is None:  # fewer, longer programs once the grid is large enough (q reused)
        blocks_per_program = max(1, min(8, (num_tokens * num_blocks) // 1024))
        blocks_per_program = 1 << (blocks_per_program.bit_length() - 1)  # a power of two: few compilations
    grid = (num_tokens, triton.cdiv(num_blocks, blocks_per_program))
    rows_per_block = tables.rows_per_block(layer, "indexer")
    paged = rows_per_block != CONTIGUOUS_ROWS_PER_BLOCK
    fp8 = tables.indexer_rows  # FP8 indexer rows, or None: rows in the queries' dtype
    if fp8 is not None:
        check_indexer_row_layout(fp8, head_dim)
    args = (queries, head_weights, scores, tables.token_seq, tables.positions, tables.layer_fields(layer),
            tables.block_ids, num_heads, num_rows, tables.block_ids.shape[1], rows_per_block if paged else 1,
            head_dim**-0.5)
    constexprs = dict(RATIO=ratio, NUM_FIELDS_=NUM_FIELDS, F_ROWS_ADDR=int(Field.INDEX_ROWS_ADDR), HEAD_DIM=head_dim,
                      ROW_BYTES=fp8.row_bytes if fp8 is not None else head_dim * queries.element_size(),
                      ROW_ALIGN=4 if fp8 is not None else 16, BLOCK_HEADS=block_heads, BLOCK_N=block_n,
                      BLOCKS_PER_PROGRAM=blocks_per_program, IEEE=queries.dtype == torch.float32, PAGED=paged,
                      FP8=fp8 is not None)
    return scores, grid, args, constexprs


def indexer_scores(queries: torch.Tensor, head_weights: torch.Tensor, tables: AttentionTables, layer: int, *,
                   ratio: int, block_n: int = 64, block_heads: int = 64, num_warps: int = 4,
                   blocks_per_program: int | None = None) -> torch.Tensor:
    """queries [T, H, d] (the activation dtype: that of plain rows), head_weights [T, H] fp32 -> scores [T, N] fp32
    (-inf: not visible). The rows are read as `tables.indexer_rows` says (plain or FP8)."""
    if tables.max_rows_visible(ratio) == 0:
        return torch.empty(queries.shape[0], 0, dtype=torch.float32, device=queries.device)
    scores, grid, args, constexprs = _score_launch(queries, head_weights, tables, layer, ratio=ratio, block_n=block_n,
                                                   block_heads=block_heads, blocks_per_program=blocks_per_program)
    _indexer_scores_kernel[grid](*args, **constexprs, num_warps=num_warps, **dependent_launch(queries.device))
    return scores


def indexer_topk(queries: torch.Tensor, head_weights: torch.Tensor, tables: AttentionTables, layer: int, *,
                 ratio: int, topk: int, block_n: int = 64) -> torch.Tensor:
    """-> topk_ids [T, topk] int64, the picks in any order (ascending at decode sizes); only rows of tokens that
    see more than `topk` rows are meaningful (the others attend to every visible row, see sparse_attention).
    When no token sees more than `topk` rows, nothing is computed (an empty [T, topk]). At decode sizes (at most
    TOPK_KERNEL_MAX_TOKENS tokens) one launch scores and picks (`indexer_scores_top_k`), else two."""
    num_tokens = queries.shape[0]
    if tables.max_rows_visible(ratio) <= topk or num_tokens == 0:
        return torch.empty(num_tokens, topk, dtype=torch.int64, device=queries.device)
    if num_tokens <= TOPK_KERNEL_MAX_TOKENS:
        return indexer_scores_top_k(queries, head_weights, tables, layer, ratio=ratio, topk=topk, block_n=block_n)[1]
    scores = indexer_scores(queries, head_weights, tables, layer, ratio=ratio, block_n=block_n)
    return top_k_columns(scores, topk)


# ------------------------------------------------------------------------------------------ top-k
TOPK_KERNEL_MAX_TOKENS = 64  # more rows of scores: torch.topk (its multi-block select fills the GPU better)
TOPK_MAX_BLOCK = 4096  # widest row kept in registers across the passes (~16K tokens of CSA context)
_RADIX_BITS = 8
_NUM_DIGITS = 32 // _RADIX_BITS


@triton.jit
def _sortable_keys(scores):
    """fp32 -> uint32 keys in the floats' order, as torch's radix select maps them: negative floats have every
    bit flipped, the others their sign bit set (so -0.0 < +0.0); NaN is the largest key."""
    bits = scores.to(tl.uint32, bitcast=True)
    keys = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(scores != scores, 0xFFFFFFFF, keys)


@triton.jit
def _load_keys(row_ptr, columns, num_cols):
    valid = columns < num_cols
    return _sortable_keys(tl.load(row_ptr + columns, mask=valid, other=0.0)), valid


@triton.jit
def _digit_histogram(keys, valid, prefix, DIGIT: tl.constexpr, RADIX_BITS: tl.constexpr):
    """Counts [2^RADIX_BITS] of digit DIGIT (0 = most significant) over the valid keys whose higher digits
    equal `prefix`'s."""
    SHIFT: tl.constexpr = 32 - RADIX_BITS * (DIGIT + 1)
    match = valid
    if DIGIT > 0:
        match = match & ((keys >> (SHIFT + RADIX_BITS)) == (prefix >> (SHIFT + RADIX_BITS)))
    digits = ((keys >> SHIFT) & ((1 << RADIX_BITS) - 1)).to(tl.int32)
    return tl.histogram(digits, 1 << RADIX_BITS, mask=match)


@triton.jit
def _select_top_k(row_ptr, out_row_ptr, num_cols, k,
                  ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, NUM_DIGITS: tl.constexpr):
    """One row's pick: scores [N] fp32 at row_ptr -> out [k] int64 at out_row_ptr, the columns of the k largest in
    ascending order, ties at the k-th value to the lowest columns (the module docstring)."""
    columns = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << RADIX_BITS)
    if ONE_BLOCK:  # the row stays in registers for every pass
        row_keys, row_valid = _load_keys(row_ptr, columns, num_cols)
    # Radix select, most significant digit first: `prefix` holds the digits of the k-th largest key found so far,
    # `remaining` how many keys sharing those digits are still to take.
    prefix = tl.full([], 0, tl.uint32)
    remaining = k
    for digit in tl.static_range(NUM_DIGITS):
        if ONE_BLOCK:
            counts = _digit_histogram(row_keys, row_valid, prefix, digit, RADIX_BITS)
        else:
            counts = tl.zeros([1 << RADIX_BITS], dtype=tl.int32)
            for start in range(0, num_cols, BLOCK):
                keys, valid = _load_keys(row_ptr, start + columns, num_cols)
                counts += _digit_histogram(keys, valid, prefix, digit, RADIX_BITS)
        at_or_above = tl.cumsum(counts, 0, reverse=True)  # [bins] keys with this digit or a larger one
        chosen = tl.max(tl.where(at_or_above >= remaining, bins, -1), 0)  # the k-th largest key's digit
        remaining -= tl.sum(tl.where(bins > chosen, counts, 0), 0)
        prefix = prefix | (chosen.to(tl.uint32) << (32 - RADIX_BITS * (digit + 1)))
    # prefix is now the k-th largest key: take every larger key and the first `remaining` equal ones
    num_written = 0
    num_equal_seen = 0
    for start in range(0, num_cols, BLOCK):
        if ONE_BLOCK:
            keys, valid = row_keys, row_valid
        else:
            keys, valid = _load_keys(row_ptr, start + columns, num_cols)
        greater = (valid & (keys > prefix)).to(tl.int32)
        equal = (valid & (keys == prefix)).to(tl.int32)
        equal_rank = num_equal_seen + tl.cumsum(equal, 0) - equal  # among the equal keys, in column order
        take = greater | (equal & (equal_rank < remaining).to(tl.int32))
        slots = num_written + tl.cumsum(take, 0) - take
        tl.store(out_row_ptr + slots, (start + columns).to(tl.int64), mask=take != 0)
        num_written += tl.sum(take, 0)
        num_equal_seen += tl.sum(equal, 0)


@triton.jit
def _topk_kernel(scores_ptr, out_ptr, num_cols, k, stride_row,
                 ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, NUM_DIGITS: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    # scores [T, N] fp32 -> out [T, k] int64; one program per row
    row = tl.program_id(0).to(tl.int64)
    _select_top_k(scores_ptr + row * stride_row, out_ptr + row * k, num_cols, k, ONE_BLOCK, BLOCK, RADIX_BITS,
                  NUM_DIGITS)


def _select_block(num_cols: int) -> tuple[int, bool]:
    """(columns per block of `_select_top_k`, whether a row fits one block)."""
    block = min(TOPK_MAX_BLOCK, max(128, triton.next_power_of_2(num_cols)))
    return block, num_cols <= block


def top_k_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, N] fp32 -> [T, k] int64: the columns of each row's k largest scores (see the module docstring:
    one launch, ascending columns, ties to the lowest columns, at decode sizes; torch.topk's otherwise)."""
    num_tokens, num_cols = scores.shape
    if not 0 < k <= num_cols:
        raise ValueError(f"top-{k} of {num_cols} columns")
    if num_tokens > TOPK_KERNEL_MAX_TOKENS or scores.dtype != torch.float32:
        return scores.topk(k, dim=-1, sorted=False).indices
    out = torch.empty(num_tokens, k, dtype=torch.int64, device=scores.device)
    if num_tokens == 0:
        return out
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    block, one_block = _select_block(num_cols)
    _topk_kernel[(num_tokens,)](scores, out, num_cols, k, scores.stride(0), ONE_BLOCK=one_block, BLOCK=block,
                                RADIX_BITS=_RADIX_BITS, NUM_DIGITS=_NUM_DIGITS, num_warps=4 if block <= 2048 else 8,
                                **dependent_launch(scores.device))
    return out


# --------------------------------------------------------------------------- scores and top-k, one launch
@triton.jit
def _indexer_scores_topk_kernel(q_ptr, weights_ptr, scores_ptr, token_seq_ptr, positions_ptr, fields_ptr,
                                block_ids_ptr, num_heads, num_rows_out, block_stride, rows_per_block, row_scale,
                                topk_ptr, counter_ptr, k,
                                RATIO: tl.constexpr, NUM_FIELDS_: tl.constexpr, F_ROWS_ADDR: tl.constexpr,
                                HEAD_DIM: tl.constexpr, ROW_BYTES: tl.constexpr, ROW_ALIGN: tl.constexpr,
                                BLOCK_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
                                IEEE: tl.constexpr, PAGED: tl.constexpr, FP8: tl.constexpr,
                                ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr,
                                NUM_DIGITS: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    # grid (T, G groups of row blocks) -> scores [T, N] fp32, topk [T, k] int64 (the last of t's G programs picks)
    t = tl.program_id(0)
    _score_row_blocks(q_ptr, weights_ptr, scores_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                      num_heads, num_rows_out, block_stride, rows_per_block, row_scale, t, tl.program_id(1),
                      RATIO, NUM_FIELDS_, F_ROWS_ADDR, HEAD_DIM, ROW_BYTES, ROW_ALIGN, BLOCK_HEADS, BLOCK_N,
                      BLOCKS_PER_PROGRAM, IEEE, PAGED, FP8)
    if take_ticket(counter_ptr + t, tl.num_programs(1)):  # every block of t's scores row is stored
        _select_top_k(scores_ptr + t.to(tl.int64) * num_rows_out, topk_ptr + t.to(tl.int64) * k, num_rows_out, k,
                      ONE_BLOCK, BLOCK, RADIX_BITS, NUM_DIGITS)


def indexer_scores_top_k(queries: torch.Tensor, head_weights: torch.Tensor, tables: AttentionTables, layer: int, *,
                         ratio: int, topk: int, block_n: int = 64, block_heads: int = 64, num_warps: int = 4,
                         blocks_per_program: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`indexer_scores` then `top_k_columns`'s kernel, in one launch: queries [T, H, d], head_weights [T, H] ->
    (scores [T, N] fp32, topk_ids [T, topk] int64 ascending), bit for bit the two launches' results.
    Needs 0 < topk <= N (N = tables.max_rows_visible(ratio)) and T <= TOPK_KERNEL_MAX_TOKENS."""
    num_tokens = queries.shape[0]
    num_rows = tables.max_rows_visible(ratio)
    if not 0 < topk <= num_rows:
        raise ValueError(f"top-{topk} of {num_rows} rows")
    if num_tokens > TOPK_KERNEL_MAX_TOKENS:
        raise ValueError(f"{num_tokens} tokens: one-launch top-k takes at most {TOPK_KERNEL_MAX_TOKENS}")
    scores, grid, args, constexprs = _score_launch(queries, head_weights, tables, layer, ratio=ratio, block_n=block_n,
                                                   block_heads=block_heads, blocks_per_program=blocks_per_program)
    topk_ids = torch.empty(num_tokens, topk, dtype=torch.int64, device=queries.device)  # [T, K]
    if num_tokens == 0:
        return scores, topk_ids
    block, one_block = _select_block(num_rows)
    _indexer_scores_topk_kernel[grid](*args, topk_ids, tile_counters(queries.device, num_tokens), topk, **constexprs,
                                      ONE_BLOCK=one_block, BLOCK=block, RADIX_BITS=_RADIX_BITS,
                                      NUM_DIGITS=_NUM_DIGITS, num_warps=num_warps, **dependent_launch(queries.device))
    return scores, topk_ids
