"""Batched writes into every sequence's KV stores, and the compressor's window pooling (docs/model.md §2.5).

All three kernels reach each sequence's tensors through the address tables of
`common.kernels.attention_layout` (one launch for the whole forward, CUDA-graph capturable):
- `write_rings`: row t of `src` [T, C] goes to slot pos mod ring of its sequence's ring (window
  ring, compressor input rings). Only the last `ring` tokens of a chunk are written: earlier
  ones would land on the same slots (a long prefill chunk), and writing both would race.
- `pool_windows`: for each token closing a ratio-m window w, the pooled row
  C_w = Σ_slot softmax_slot(Z) ⊙ K per channel, fp32. Slots are window w's m positions (HCA) or,
  overlapping (CSA), the first halves of window w-1's positions then the second halves of window
  w's (window 0's first halves are absent: gate -inf). A slot position at or after the chunk's
  start is read from this forward's projected inputs, an earlier one from the input ring, which
  must therefore be written only after the pooling.
- `write_rows`: row i of `rows` [Nc, d] (already normed, rotated) becomes compressed row
  w = pos // m of its sequence, in the own tensor or the paged pool's block.
With `tables.closing_predicated` (static decode tables of a captured step, whose positions change
every replay) the "closing tokens" are every token of the forward and the kernels test (pos + 1)
mod m == 0 themselves: non-closing tokens pool zeros and write nothing, so the launch shape does
not depend on which windows close.
Legend: T tokens, C channels, m ratio, d row dim, Nc closing tokens, B sequences, F fields.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.attention_layout import NUM_FIELDS, AttentionTables, Field


@triton.jit
def _write_rings_kernel(src_ptr, src2_ptr, dst_like_ptr, token_seq_ptr, positions_ptr, seq_info_ptr, fields_ptr,
                        num_channels, NUM_FIELDS_: tl.constexpr, F_ADDR: tl.constexpr, F_ADDR2: tl.constexpr,
                        F_RING: tl.constexpr, HAS_SECOND: tl.constexpr, DST_BYTES: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    t = tl.program_id(0)
    channel_block = tl.program_id(1)
    b = tl.load(token_seq_ptr + t)
    pos = tl.load(positions_ptr + t)
    chunk_end = tl.load(seq_info_ptr + b * 3) + tl.load(seq_info_ptr + b * 3 + 2)
    fields = fields_ptr + b.to(tl.int64) * NUM_FIELDS_
    ring = tl.load(fields + F_RING)
    if pos >= chunk_end - ring:  # else a later token of the chunk owns this slot
        offset = (pos % ring) * num_channels * DST_BYTES
        channels = channel_block * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = channels < num_channels
        src = t.to(tl.int64) * num_channels + channels
        dst = (tl.load(fields + F_ADDR) + offset).to(tl.pointer_type(dst_like_ptr.dtype.element_ty))
        tl.store(dst + channels, tl.load(src_ptr + src, mask=mask).to(dst_like_ptr.dtype.element_ty), mask=mask)
        if HAS_SECOND:
            dst2 = (tl.load(fields + F_ADDR2) + offset).to(tl.pointer_type(dst_like_ptr.dtype.element_ty))
            tl.store(dst2 + channels, tl.load(src2_ptr + src, mask=mask).to(dst_like_ptr.dtype.element_ty),
                     mask=mask)


def write_rings(src: torch.Tensor, ring_like: torch.Tensor, tables: AttentionTables, layer: int,
                address_field: Field, ring_field: Field, *, second: tuple[torch.Tensor, Field] | None = None,
                block_c: int = 512) -> None:
    """src [T, C] -> each token's slot of the ring at `address_field` (size at `ring_field`);
    `second` = (src2 [T, C], its ring's field) writes a same-shaped ring in the same launch (the
    compressor's K and Z). ring_like: any ring of this kind (gives the dtype)."""
    src = src.contiguous()
    src2 = second[0].contiguous() if second is not None else src
    num_tokens, num_channels = src.shape
    block_c = min(block_c, triton.next_power_of_2(num_channels))
    grid = (num_tokens, triton.cdiv(num_channels, block_c))
    _write_rings_kernel[grid](src, src2, ring_like, tables.token_seq, tables.positions, tables.seq_info,
                              tables.layer_fields(layer), num_channels, NUM_FIELDS_=NUM_FIELDS,
                              F_ADDR=int(address_field),
                              F_ADDR2=int(second[1] if second is not None else address_field),
                              F_RING=int(ring_field), HAS_SECOND=second is not None,
                              DST_BYTES=ring_like.element_size(), BLOCK_C=block_c, num_warps=4)


@triton.jit
def _pool_windows_kernel(kv_ptr, score_ptr, ring_like_ptr, out_ptr, closing_ptr, token_seq_ptr, positions_ptr,
                         seq_info_ptr, fields_ptr, row_dim,
                         RATIO: tl.constexpr, OVERLAP: tl.constexpr, NUM_SLOTS: tl.constexpr,
                         NUM_FIELDS_: tl.constexpr, F_KV: tl.constexpr, F_SCORE: tl.constexpr,
                         F_RING: tl.constexpr, BLOCK_D: tl.constexpr, PREDICATED: tl.constexpr):
    i = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_mask = channels < row_dim
    t = tl.load(closing_ptr + i)
    b = tl.load(token_seq_ptr + t)
    position = tl.load(positions_ptr + t)
    window = position // RATIO
    if PREDICATED:  # every token has a program; only those closing a window pool (others store zeros)
        channel_mask = channel_mask & ((position + 1) % RATIO == 0)
    chunk_start = tl.load(seq_info_ptr + b * 3)
    chunk_offset = tl.load(seq_info_ptr + b * 3 + 1)
    fields = fields_ptr + b.to(tl.int64) * NUM_FIELDS_
    ring = tl.load(fields + F_RING)
    slots = tl.arange(0, NUM_SLOTS)
    if OVERLAP:
        width = 2 * row_dim
        first_half = slots < RATIO
        slot_pos = tl.where(first_half, (window - 1) * RATIO + slots, window * RATIO + slots - RATIO)
        slot_valid = (slots < 2 * RATIO) & (slot_pos >= 0)
        channel_offset = tl.where(first_half, 0, row_dim)
    else:
        width = row_dim
        slot_pos = window * RATIO + slots
        slot_valid = slots < RATIO
        channel_offset = slots * 0
    from_new = slot_pos >= chunk_start
    new_row = tl.where(from_new, chunk_offset + slot_pos - chunk_start, 0).to(tl.int64)
    # slot positions are consecutive: one scalar division, then a single wrap (no per-element division)
    first_pos = tl.maximum(tl.min(tl.where(slot_valid, slot_pos, 1 << 62), axis=0), 0)
    ring_slot = (first_pos % ring) + (slot_pos - first_pos)
    ring_slot = tl.where(ring_slot >= ring, ring_slot - ring, ring_slot)
    ring_slot = tl.where(slot_valid & ~from_new, ring_slot, 0).to(tl.int64)
    column = (channel_offset[:, None] + channels[None, :]).to(tl.int64)  # [NS, BD]
    mask = slot_valid[:, None] & channel_mask[None, :]
    ring_kv = (tl.load(fields + F_KV) + ring_slot * width * 4).to(tl.pointer_type(tl.float32))
    ring_score = (tl.load(fields + F_SCORE) + ring_slot * width * 4).to(tl.pointer_type(tl.float32))
    new_mask = mask & from_new[:, None]
    old_mask = mask & ~from_new[:, None]
    kv_new = tl.load(kv_ptr + new_row[:, None] * width + column, mask=new_mask, other=0.0).to(tl.float32)
    kv_old = tl.load(ring_kv[:, None] + column, mask=old_mask, other=0.0)
    z_new = tl.load(score_ptr + new_row[:, None] * width + column, mask=new_mask, other=0.0).to(tl.float32)
    z_old = tl.load(ring_score[:, None] + column, mask=old_mask, other=0.0)
    kv = tl.where(from_new[:, None], kv_new, kv_old)
    z = tl.where(mask, tl.where(from_new[:, None], z_new, z_old), float("-inf"))  # [NS, BD]
    z_max = tl.max(z, axis=0)
    e = tl.exp(z - z_max[None, :])
    pooled = tl.sum(e * kv, axis=0) / tl.sum(e, axis=0)
    if PREDICATED:
        pooled = tl.where(channel_mask, pooled, 0.0)
        channel_mask = channels < row_dim
    tl.store(out_ptr + i.to(tl.int64) * row_dim + channels, pooled, mask=channel_mask)


def pool_windows(kv: torch.Tensor, score: torch.Tensor, ring_like: torch.Tensor, tables: AttentionTables, layer: int,
                 *, ratio: int, overlap: bool, row_dim: int, indexer: bool,
                 block_d: int | None = None) -> torch.Tensor:
    """kv, score [T, C] (this forward's projected inputs) -> pooled rows [Nc, d] fp32, in
    `tables.closing_tokens(ratio)` order."""
    closing, num_closing = tables.closing_tokens(ratio)  # predicated tables: every token, in order
    out = torch.empty(num_closing, row_dim, dtype=torch.float32, device=kv.device)
    if num_closing == 0:
        return out
    fields = (Field.INDEX_INPUT_KV_ADDR, Field.INDEX_INPUT_SCORE_ADDR, Field.INDEX_INPUT_RING) if indexer else (
        Field.INPUT_KV_ADDR, Field.INPUT_SCORE_ADDR, Field.INPUT_RING)
    num_slots = triton.next_power_of_2((2 if overlap else 1) * ratio)
    # a [slots, BLOCK_D] tile of K, Z and their gathered pointers: keep it ~2K elements (no spills)
    block_d = min(block_d or max(16, 2048 // num_slots), triton.next_power_of_2(row_dim))
    grid = (num_closing, triton.cdiv(row_dim, block_d))
    _pool_windows_kernel[grid](kv.contiguous(), score.contiguous(), ring_like, out, closing, tables.token_seq,
                               tables.positions, tables.seq_info, tables.layer_fields(layer), row_dim,
                               RATIO=ratio, OVERLAP=overlap, NUM_SLOTS=num_slots, NUM_FIELDS_=NUM_FIELDS,
                               F_KV=int(fields[0]), F_SCORE=int(fields[1]), F_RING=int(fields[2]),
                               BLOCK_D=block_d, PREDICATED=tables.closing_predicated, num_warps=4)
    return out


@triton.jit
def _write_rows_kernel(rows_ptr, dst_like_ptr, closing_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                       row_dim, block_stride, rows_per_block, RATIO: tl.constexpr, NUM_FIELDS_: tl.constexpr,
                       F_ROWS: tl.constexpr, DST_BYTES: tl.constexpr, BLOCK_D: tl.constexpr,
                       PREDICATED: tl.constexpr):
    i = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = channels < row_dim
    t = tl.load(closing_ptr + i)
    b = tl.load(token_seq_ptr + t).to(tl.int64)
    position = tl.load(positions_ptr + t)
    row = position // RATIO
    if PREDICATED:  # only tokens closing a window write; the others look up row 0's block (always in the table)
        closes = (position + 1) % RATIO == 0
        mask = mask & closes
        row = tl.where(closes, row, 0)
    block = tl.load(block_ids_ptr + b * block_stride + row // rows_per_block)
    addr = tl.load(fields_ptr + b * NUM_FIELDS_ + F_ROWS) + (block * rows_per_block + row % rows_per_block) * (
        row_dim * DST_BYTES)
    dst = addr.to(tl.pointer_type(dst_like_ptr.dtype.element_ty))
    values = tl.load(rows_ptr + i.to(tl.int64) * row_dim + channels, mask=mask)
    tl.store(dst + channels, values.to(dst_like_ptr.dtype.element_ty), mask=mask)


def write_rows(rows: torch.Tensor, dst_like: torch.Tensor, tables: AttentionTables, layer: int, *, ratio: int,
               indexer: bool, block_d: int = 512) -> None:
    """rows [Nc, d] (closing order) -> compressed row pos // m of each closing token's sequence."""
    closing, num_closing = tables.closing_tokens(ratio)
    if num_closing == 0:
        return
    rows = rows.contiguous()
    row_dim = rows.shape[1]
    block_d = min(block_d, triton.next_power_of_2(row_dim))
    which = "indexer" if indexer else "compressor"
    grid = (num_closing, triton.cdiv(row_dim, block_d))
    _write_rows_kernel[grid](rows, dst_like, closing, tables.token_seq, tables.positions, tables.layer_fields(layer),
                             tables.block_ids, row_dim, tables.block_ids.shape[1], tables.rows_per_block(layer, which),
                             RATIO=ratio, NUM_FIELDS_=NUM_FIELDS,
                             F_ROWS=int(Field.INDEX_ROWS_ADDR if indexer else Field.ROWS_ADDR),
                             DST_BYTES=dst_like.element_size(), BLOCK_D=block_d,
                             PREDICATED=tables.closing_predicated, num_warps=4)
