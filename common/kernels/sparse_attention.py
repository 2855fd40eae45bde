"""Sparse attention of DeepSeek-V4 over window ∪ compressed rows, every sequence in one launch.

Query token t (position p, sequence b) attends, with one latent K = V row per key (docs/model.md §2.3,
§2.7), over:
- the window: positions max(0, p-W+1) .. p. A key position at or after the chunk's start is a
  row of this forward's `new_kv` [T, hd]; an earlier one is read from b's window ring at slot
  pos mod ring (the ring is written only after every read of it, after this kernel or by its last program of
  the sequence, so no new row overwrites an old one still needed, whatever the chunk length);
- the compressed rows: HCA every closed window (rows 0 .. (p+1)//m - 1); CSA the K entries of
  `topk_ids[t]` (the indexer's picks, in any order) when more than K rows are visible, else every
  visible row (what the indexer would pick: no scores needed, no sentinel ids);
- the per-head sink: exp(sink_h) joins the softmax denominator with no value.
Softmax in fp32 with an online maximum (flash-attention style): nothing of size [T, L] is ever
materialised. One program covers (token, block of heads, split of the keys); with more than one
split (flash-decoding, for small batches that would leave SMs idle) each split writes an
unnormalised partial (acc, max, sum) and takes a ticket (`split_k.take_ticket`); the last split of a
(token, head block) to arrive merges them with the sink (`_combine_heads`), in the same launch. The launch that
writes the output can also rotate its rotary channels back (`rotate_back`), the attention's last glue step, and
write this forward's rows into the window rings (`write_ring`): the last program of each sequence to take a ticket
does it, after every program of the sequence read the ring.

Stored rows are in the activation dtype, or FP8 main rows (`tables.main_rows`, common/model/kv_rows.py):
then each key block is dequantized in registers, e4m3 code × 2^(scale byte − 127) for the non-rotary
channels (the row's scale bytes read as two 32-bit words, the block's byte shifted out) and the bf16
rotary channels as they are, in q's dtype (exact in bf16 and fp32); nothing is dequantized to memory.
Rows of this forward's own tokens come from `new_kv` as computed in either case; with FP8 rows a
program runs over its stored keys first and over those rows after, so the dequantizing loop loads
one kind of row.

Every per-token quantity comes from the position and the tables of
`common.kernels.attention_layout`, so the same kernel serves decode, verification of several
draft tokens per sequence (each is a query with its own position: causal by construction) and
chunked prefill. Launches allocate nothing outside torch's allocator and take host integers only
from the tables' host-side maxima, so a decode step is CUDA-graph capturable.
Legend: T tokens, H heads, hd head dim, K top-k, S key splits, BH heads per program, BN keys per
block, B sequences, F fields.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.attention_layout import (
    CONTIGUOUS_ROWS_PER_BLOCK, NUM_FIELDS, AttentionTables, Field, check_main_row_layout,
)
from moemesh.common.kernels.dependent_launch import dependent_launch, wait_for_inputs
from moemesh.common.kernels.kv_write import _store_fp8_main_row
from moemesh.common.kernels.norm_rope import rotate_pairs
from moemesh.common.kernels.sparse_attention_plan import (
    SparseAttentionConfig, choose_num_splits, default_config, max_keys_of, plan_splits,
)
from moemesh.common.kernels.split_k import take_ticket, tile_counters


RING_IN_LAUNCH_MAX_TOKENS = 64  # forwards up to this size write the window rings in the attention launch


@triton.jit
def _key_rows(j, valid, t, b, n_win, win_lo, ring_base, use_picks, chunk_start, chunk_offset, ring_addr,
              ring_size, rows_addr, topk_ptr, topk_stride, block_ids_ptr, block_stride, rows_per_block,
              ROW_BYTES: tl.constexpr, ALIGN: tl.constexpr, USE_TOPK: tl.constexpr, PAGED: tl.constexpr):
    """For key indices j [BN] of token t: (stored row byte address [BN] int64, from_new [BN] bool: the key is
    row new_row [BN] of this forward's new_kv instead).

    No 64-bit division in here (it compiles to a slow subroutine per element): the ring slot of
    window key j is ring_base + j wrapped once (j < window <= ring), row blocks divide in 32 bits
    and only for a paged store (contiguous stores: row address = base + row · row_bytes)."""
    is_win = j < n_win
    key_pos = win_lo + j
    from_new = is_win & (key_pos >= chunk_start)
    new_row = tl.where(from_new, chunk_offset + key_pos - chunk_start, 0)
    ring_slot = ring_base + j
    ring_slot = tl.where(ring_slot >= ring_size, ring_slot - ring_size, ring_slot)
    r = tl.where(is_win, 0, j - n_win)
    row_mask = valid & (j >= n_win)
    row_id = r.to(tl.int32)
    if USE_TOPK:  # more visible rows than K: the picks (any order); else every visible row, in order
        picked = tl.load(topk_ptr + t.to(tl.int64) * topk_stride + r, mask=row_mask & use_picks, other=0)
        row_id = tl.where(use_picks, picked.to(tl.int32), row_id)
    if PAGED:
        block = tl.load(block_ids_ptr + b.to(tl.int64) * block_stride + row_id // rows_per_block, mask=row_mask,
                        other=0)
        row_index = block * rows_per_block + (row_id % rows_per_block)
    else:
        row_index = row_id.to(tl.int64)
    row_addr = rows_addr + row_index * ROW_BYTES
    win_addr = ring_addr + tl.where(is_win, ring_slot, 0).to(tl.int64) * ROW_BYTES
    addr = tl.multiple_of(tl.where(is_win, win_addr, row_addr), ALIGN)  # rows start ALIGN-byte aligned
    return addr, from_new, new_row.to(tl.int64)


@triton.jit
def _plain_keys(addr, from_new, new_row, valid, new_kv_ptr, dims, HEAD_DIM: tl.constexpr):
    """Keys [BN, hd] from rows stored in new_kv's dtype (16-byte aligned), or from new_kv itself."""
    ext = addr.to(tl.pointer_type(new_kv_ptr.dtype.element_ty))
    new = new_kv_ptr + new_row * HEAD_DIM
    rows = tl.multiple_of(tl.where(from_new, new, ext), 16)
    return tl.load(rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _fp8_keys(addr, stored, dims, NOPE: tl.constexpr, BLOCK: tl.constexpr, SCALE_OFFSET: tl.constexpr,
              KEY_DTYPE: tl.constexpr):
    """Keys [BN, hd] in KEY_DTYPE from the FP8 main rows at byte addresses addr [BN] (rows where `stored`),
    dequantized in registers: e4m3 code × 2^(scale byte − 127) for the nope channels, the bf16 rope channels."""
    is_nope = dims < NOPE  # [hd]
    codes = tl.load(addr.to(tl.pointer_type(tl.uint8))[:, None] + dims[None, :],
                    mask=stored[:, None] & is_nope[None, :], other=0)  # [BN, hd] e4m3 bytes
    rope = tl.load((addr + NOPE).to(tl.pointer_type(tl.bfloat16))[:, None] + (dims - NOPE)[None, :],
                   mask=stored[:, None] & ~is_nope[None, :], other=0.0)  # [BN, hd] bf16
    scale_words = (addr + SCALE_OFFSET).to(tl.pointer_type(tl.int32))
    low = tl.load(scale_words, mask=stored, other=0)  # [BN] the scale bytes of blocks 0-3
    high = tl.load(scale_words + 1, mask=stored, other=0)  # [BN] blocks 4-7
    block = dims // BLOCK  # [hd]
    word = tl.where((block < 4)[None, :], low[:, None], high[:, None])  # [BN, hd]
    scale_bits = ((word >> ((block & 3) * 8)[None, :]) & 0xFF) << 23  # [BN, hd]
    scale = scale_bits.to(tl.float32, bitcast=True).to(KEY_DTYPE)  # 2^(byte - 127), exact in bf16 too
    nope = codes.to(tl.float8e4nv, bitcast=True).to(KEY_DTYPE) * scale  # exact: 4 significant bits
    return tl.where(is_nope[None, :], nope, rope.to(KEY_DTYPE))


@triton.jit
def _attend_block(q, keys, valid, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """Keys [BN, hd] (= values; `valid` [BN]) into the online softmax of q [BH, hd] -> (m_i, l_i, acc)."""
    if IEEE:
        logits = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        logits = tl.dot(q, tl.trans(keys))
    logits = tl.where(valid[None, :], logits * scale, float("-inf"))  # [BH, BN]
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys)
    return m_new, l_i, acc


@triton.jit
def _sparse_attention_kernel(
        q_ptr, new_kv_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr, sink_ptr, topk_ptr, cos_ptr, sin_ptr,
        token_seq_ptr, positions_ptr, seq_info_ptr, fields_ptr, block_ids_ptr,
        scale, num_heads, topk_stride, block_stride, rows_per_block, keys_per_split, num_splits, split_size_ptr,
        WINDOW: tl.constexpr, RATIO: tl.constexpr, USE_TOPK: tl.constexpr, NUM_FIELDS_: tl.constexpr,
        F_WIN_ADDR: tl.constexpr, F_WIN_RING: tl.constexpr, F_ROWS_ADDR: tl.constexpr,
        HEAD_DIM: tl.constexpr, ROW_BYTES: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, IEEE: tl.constexpr, PAGED: tl.constexpr, SPLIT_SIZE_ON_DEVICE: tl.constexpr,
        FP8: tl.constexpr, NOPE: tl.constexpr, SCALE_BLOCK: tl.constexpr, SCALE_OFFSET: tl.constexpr,
        ROPE_HALF: tl.constexpr, WRITE_RING: tl.constexpr, NUM_SCALE_BLOCKS: tl.constexpr,
        SCALE_BLOCKS_P2: tl.constexpr, ROPE_P2: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    t = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(token_seq_ptr + t)
    pos = tl.load(positions_ptr + t)
    chunk_start = tl.load(seq_info_ptr + b * 3)
    chunk_offset = tl.load(seq_info_ptr + b * 3 + 1)
    fields = fields_ptr + b.to(tl.int64) * NUM_FIELDS_
    ring_addr = tl.load(fields + F_WIN_ADDR)
    ring_size = tl.load(fields + F_WIN_RING)
    rows_addr = tl.load(fields + F_ROWS_ADDR)
    n_win = tl.minimum(pos + 1, WINDOW)
    win_lo = pos - n_win + 1
    ring_base = (win_lo % ring_size).to(tl.int32)  # one scalar division per program
    n_rows = pos * 0
    use_picks = pos < 0
    if RATIO > 0:
        n_rows = (pos + 1) // RATIO
        if USE_TOPK:
            use_picks = n_rows > topk_stride
            n_rows = tl.minimum(n_rows, topk_stride)
    n_total = n_win + n_rows
    if SPLIT_SIZE_ON_DEVICE:  # graph replays: the host writes this step's split size before the replay
        keys_per_split = tl.load(split_size_ptr)
    lo = split.to(tl.int64) * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_total)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    dims = tl.arange(0, HEAD_DIM)
    q_rows = t.to(tl.int64) * num_heads + heads
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + dims[None, :], mask=head_mask[:, None], other=0.0)  # [BH, hd]
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    if FP8:  # the stored keys (FP8 rows; the split's keys of this forward skipped), then this forward's (new_kv)
        new_lo = tl.minimum(tl.maximum(chunk_start - win_lo, 0), n_win)  # window keys new_lo .. n_win-1 are new
        gap_lo = tl.minimum(tl.maximum(new_lo, lo), hi)
        gap_hi = tl.maximum(tl.minimum(n_win, hi), gap_lo)  # this split's new keys: gap_lo .. gap_hi-1
        num_stored = (hi - lo) - (gap_hi - gap_lo)
        for s0 in range(0, num_stored, BLOCK_N):
            stored_index = lo + s0 + tl.arange(0, BLOCK_N)
            valid = stored_index < lo + num_stored
            j = tl.where(stored_index >= gap_lo, stored_index + (gap_hi - gap_lo), stored_index)
            addr, _, _ = _key_rows(j, valid, t, b, n_win, win_lo, ring_base, use_picks, chunk_start, chunk_offset,
                                   ring_addr, ring_size, rows_addr, topk_ptr, topk_stride, block_ids_ptr,
                                   block_stride, rows_per_block, ROW_BYTES, ROW_ALIGN, USE_TOPK, PAGED)
            keys = _fp8_keys(addr, valid, dims, NOPE, SCALE_BLOCK, SCALE_OFFSET, q.dtype)  # [BN, hd]
            m_i, l_i, acc = _attend_block(q, keys, valid, m_i, l_i, acc, scale, IEEE)
        for j0 in range(gap_lo, gap_hi, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            valid = j < gap_hi
            new_row = (chunk_offset + win_lo + j - chunk_start).to(tl.int64)
            keys = tl.load(new_kv_ptr + new_row[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None],
                           other=0.0)  # [BN, hd]
            m_i, l_i, acc = _attend_block(q, keys, valid, m_i, l_i, acc, scale, IEEE)
    else:
        for j0 in range(lo, hi, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            valid = j < hi
            addr, from_new, new_row = _key_rows(j, valid, t, b, n_win, win_lo, ring_base, use_picks, chunk_start,
                                                chunk_offset, ring_addr, ring_size, rows_addr, topk_ptr,
                                                topk_stride, block_ids_ptr, block_stride, rows_per_block, ROW_BYTES,
                                                ROW_ALIGN, USE_TOPK, PAGED)
            keys = _plain_keys(addr, from_new, new_row, valid, new_kv_ptr, dims, HEAD_DIM)  # [BN, hd]
            m_i, l_i, acc = _attend_block(q, keys, valid, m_i, l_i, acc, scale, IEEE)
    if SPLIT:  # the split's partial, then the last split of (token, head block) to arrive merges them all
        part = (t.to(tl.int64) * num_splits + split) * num_heads + heads  # [BH]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=head_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_mask)
        if take_ticket(counter_ptr + t * tl.num_programs(1) + head_block, num_splits):
            _combine_heads(part_acc_ptr, part_ml_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, t, heads, head_mask,
                           num_heads, num_splits, HEAD_DIM, BLOCK_H, ROPE_HALF)
    else:
        sink = tl.load(sink_ptr + heads, mask=head_mask, other=0.0)
        denominator = l_i + tl.exp(sink - m_i)
        out = _rotated_back(acc / denominator[:, None], cos_ptr, sin_ptr, t, out_ptr.dtype.element_ty,
                            HEAD_DIM, BLOCK_H, ROPE_HALF)
        tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + dims[None, :], out, mask=head_mask[:, None])
    if WRITE_RING:  # the last program of the sequence, after every program of it read the ring: its new rows in
        chunk_len = tl.load(seq_info_ptr + b * 3 + 2)
        num_programs = chunk_len * tl.num_programs(1) * tl.num_programs(2)
        if take_ticket(counter_ptr + tl.num_programs(0) * tl.num_programs(1) + b, num_programs):
            for j in range(tl.maximum(chunk_len - ring_size, 0), chunk_len):
                row = new_kv_ptr + (chunk_offset + j).to(tl.int64) * HEAD_DIM
                slot_addr = ring_addr + ((chunk_start + j) % ring_size) * ROW_BYTES
                if FP8:
                    _store_fp8_main_row(row, slot_addr, chunk_len > 0, NOPE, HEAD_DIM - NOPE, SCALE_BLOCK, NUM_SCALE_BLOCKS,
                                        SCALE_BLOCKS_P2, ROPE_P2, SCALE_OFFSET, ROW_BYTES)
                else:
                    tl.store(slot_addr.to(tl.pointer_type(new_kv_ptr.dtype.element_ty)) + dims, tl.load(row + dims))


@triton.jit
def _rotated_back(out, cos_ptr, sin_ptr, t, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                  ROPE_HALF: tl.constexpr):
    """out [BH, hd] fp32 -> rounded to dtype, then (ROPE_HALF > 0) its trailing 2·ROPE_HALF channels rotated
    back by token t's angles (pairs (2i, 2i+1), fp32 rotation of the rounded values, rounded again: the
    roundings of a separate `apply_rope(out, cos, sin, inverse=True)`); -> [BH, hd] in dtype."""
    out = out.to(dtype)
    if ROPE_HALF > 0:
        pairs = tl.arange(0, HEAD_DIM // 2)
        first = HEAD_DIM // 2 - ROPE_HALF
        rotary = pairs >= first
        angle = tl.where(rotary, pairs - first, 0)
        cos = tl.load(cos_ptr + t.to(tl.int64) * ROPE_HALF + angle, mask=rotary, other=1.0)[None, :]
        sin = -tl.load(sin_ptr + t.to(tl.int64) * ROPE_HALF + angle, mask=rotary, other=0.0)[None, :]
        even, odd = tl.split(tl.reshape(out.to(tl.float32), [BLOCK_H, HEAD_DIM // 2, 2]))  # [BH, hd/2] each
        rotated_even, rotated_odd = rotate_pairs(even, odd, cos, sin)
        new_even = tl.where(rotary[None, :], rotated_even.to(dtype), even.to(dtype))
        new_odd = tl.where(rotary[None, :], rotated_odd.to(dtype), odd.to(dtype))
        out = tl.reshape(tl.join(new_even, new_odd), [BLOCK_H, HEAD_DIM])
    return out


@triton.jit
def _combine_heads(part_acc_ptr, part_ml_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, t, heads, head_mask, num_heads,
                   num_splits, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, ROPE_HALF: tl.constexpr):
    """out[t, h] = Σ_s acc_s e^{m_s - M} / (Σ_s l_s e^{m_s - M} + e^{sink_h - M}), M = max_s m_s, splits read in
    order s = 0..S-1 (deterministic whichever split arrived last), then rotated back as `_rotated_back` says."""
    dims = tl.arange(0, HEAD_DIM)
    m_all = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    for split in range(0, num_splits):
        part = (t.to(tl.int64) * num_splits + split) * num_heads + heads
        m_all = tl.maximum(m_all, tl.load(part_ml_ptr + part * 2, mask=head_mask, other=-1.0e30))
    sink = tl.load(sink_ptr + heads, mask=head_mask, other=0.0)
    denominator = tl.exp(sink - m_all)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for split in range(0, num_splits):
        part = (t.to(tl.int64) * num_splits + split) * num_heads + heads
        weight = tl.exp(tl.load(part_ml_ptr + part * 2, mask=head_mask, other=-1.0e30) - m_all)
        denominator += weight * tl.load(part_ml_ptr + part * 2 + 1, mask=head_mask, other=0.0)
        acc += weight[:, None] * tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                                         mask=head_mask[:, None], other=0.0)
    out = _rotated_back(acc / denominator[:, None], cos_ptr, sin_ptr, t, out_ptr.dtype.element_ty, HEAD_DIM, BLOCK_H,
                        ROPE_HALF)
    rows = t.to(tl.int64) * num_heads + heads
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], out, mask=head_mask[:, None])


def sparse_attention(q: torch.Tensor, new_kv: torch.Tensor, sink: torch.Tensor, scale: float,
                     tables: AttentionTables, layer: int, *, window: int, ratio: int,
                     topk_ids: torch.Tensor | None = None, config: SparseAttentionConfig | None = None,
                     rotate_back: tuple[torch.Tensor, torch.Tensor] | None = None,
                     write_ring: bool = False) -> torch.Tensor:
    """q [T, H, hd], new_kv [T, hd] (this forward's rows, in the activation dtype), sink [H] fp32,
    topk_ids [T, K] int (CSA; any order, read only for tokens seeing more than K rows)
    -> out [T, H, hd] in q's dtype.

    ratio: 0 for window-only layers; HCA attends every closed row when topk_ids is None.
    rotate_back (cos, sin) [T, R/2] fp32: the output's trailing R channels come back rotated by minus each
    token's angles (the values carried rotated dims), in the same launch: `apply_rope(out, cos, sin,
    inverse=True)` bit for bit.
    write_ring: new_kv's rows also go into the window rings, as `kv_write.write_rings` writes them, by the last
    program of each sequence (a ticket over its programs, so every read of the ring comes first)."""
    num_tokens, num_heads, head_dim = q.shape
    if rotate_back is not None:
        cos, sin = (part.float().contiguous() for part in rotate_back)
        rope_half = cos.shape[-1]
        if cos.shape != (num_tokens, rope_half) or sin.shape != cos.shape or 2 * rope_half > head_dim:
            raise ValueError(f"rotate_back cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit q "
                             f"{tuple(q.shape)}")
    else:
        cos = sin = sink  # unused placeholder pointers
        rope_half = 0
    config = config or default_config(num_tokens, fp8_rows=tables.main_rows is not None)
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two")
    q = q.contiguous()
    new_kv = new_kv.contiguous()
    out = torch.empty_like(q)
    use_topk = topk_ids is not None
    if use_topk:
        topk_ids = topk_ids.contiguous()
    device_split_size = tables.device_split_size(window, ratio, topk_ids.shape[1] if use_topk else None)
    if device_split_size is None:  # host figures of this forward steer the launch
        plan = plan_splits(num_tokens, num_heads, max_keys_of(tables, window, ratio,
                                                              topk_ids.shape[1] if use_topk else None), config)
        block_h, num_head_blocks, num_splits, keys_per_split = (plan.block_h, plan.num_head_blocks, plan.num_splits,
                                                                plan.keys_per_split)
        split_size_ptr = tables.token_seq  # unused placeholder pointer
    else:  # static tables (a captured decode step): the most splits any step of >= min_real_tokens tokens can
        # plan (fewer tokens plan more splits; the key count never bounds it here), split size on the device
        block_h = min(config.block_h, triton.next_power_of_2(num_heads))
        num_head_blocks = triton.cdiv(num_heads, block_h)
        num_splits = choose_num_splits(tables.min_real_tokens, num_head_blocks, 1 << 40, config)
        keys_per_split = config.block_n  # unused: read from split_size_ptr
        split_size_ptr = device_split_size
    if not use_topk:
        topk_ids = tables.token_seq  # unused placeholder pointer
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_tokens, num_splits, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_splits, num_heads, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    counters = out  # unused placeholder pointer
    if split or write_ring:  # split merges [T, head blocks], then ring writes [B]
        counters = tile_counters(q.device, num_tokens * num_head_blocks + tables.seq_info.shape[0])
    rows_per_block = tables.rows_per_block(layer, "compressor") if ratio else 1
    paged = rows_per_block != CONTIGUOUS_ROWS_PER_BLOCK
    rows_per_block = rows_per_block if paged else 1
    fp8 = tables.main_rows  # FP8 main rows, or None: rows in new_kv's dtype
    if fp8 is not None:
        check_main_row_layout(fp8, head_dim)
    grid = (num_tokens, num_head_blocks, num_splits)
    _sparse_attention_kernel[grid](
        q, new_kv, out, part_acc, part_ml, counters, sink, topk_ids, cos, sin,
        tables.token_seq, tables.positions, tables.seq_info, tables.layer_fields(layer), tables.block_ids,
        scale, num_heads, max(1, topk_ids.shape[1] if use_topk else 1), tables.block_ids.shape[1], rows_per_block,
        keys_per_split, num_splits, split_size_ptr,
        WINDOW=window, RATIO=ratio, USE_TOPK=use_topk, NUM_FIELDS_=NUM_FIELDS,
        F_WIN_ADDR=int(Field.WINDOW_ADDR), F_WIN_RING=int(Field.WINDOW_RING), F_ROWS_ADDR=int(Field.ROWS_ADDR),
        HEAD_DIM=head_dim, ROW_BYTES=fp8.row_bytes if fp8 is not None else head_dim * new_kv.element_size(),
        ROW_ALIGN=8 if fp8 is not None else 16, BLOCK_H=block_h, BLOCK_N=config.block_n,
        SPLIT=split, IEEE=q.dtype == torch.float32, PAGED=paged, SPLIT_SIZE_ON_DEVICE=device_split_size is not None,
        FP8=fp8 is not None, NOPE=fp8.nope_dim if fp8 is not None else 0,
        SCALE_BLOCK=fp8.block_size if fp8 is not None else 1, SCALE_OFFSET=fp8.scale_offset if fp8 is not None else 0,
        ROPE_HALF=rope_half, WRITE_RING=write_ring,
        NUM_SCALE_BLOCKS=fp8.num_blocks if fp8 is not None else 1,
        SCALE_BLOCKS_P2=triton.next_power_of_2(fp8.num_blocks) if fp8 is not None else 1,
        ROPE_P2=triton.next_power_of_2(fp8.rope_dim) if fp8 is not None else 1,
        num_warps=config.num_warps, num_stages=config.num_stages, **dependent_launch(q.device))
    return out
