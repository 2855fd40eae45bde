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

FP8 main rows (`tables.main_rows`, the layout of common/model/kv_rows.py): the window ring writes and
the compressed row writes quantize each row in the kernel, one program per row, to exactly the bytes
`pack_main_rows` gives: per block of 64 non-rotary channels the scale 2^ceil(log2(max(amax, 1e-4) / 448))
(its ue8m0 byte = the exponent + 127), the codes e4m3(clamp(x / scale, ±448)) rounded to nearest even,
the rotary channels rounded to bf16 (nearest even), the pad bytes zero. Both roundings are done with
integer operations, identical on the GPU and in the interpreter. FP8 indexer rows (`tables.indexer_rows`) are
quantized the same way with one block per row, to the bytes `pack_indexer_rows` gives: the e4m3 codes, then the
scale 2^ceil(log2(max(amax, 1e-4) / 448)) as an fp32. The compressor's input rings are written as they are.
Legend: T tokens, C channels, m ratio, d row dim, Nc closing tokens, B sequences, F fields,
NB scale blocks (padded to a power of two), b block size, P rotary channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.attention_layout import (
    NUM_FIELDS, AttentionTables, Field, MainRowBytes, check_indexer_row_layout, check_main_row_layout,
)
from moemesh.common.kernels.dependent_launch import dependent_launch, wait_for_inputs

E4M3_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-4)  # common/model/qat.py ACT_QUANT_AMAX_FLOOR: an all-zero block keeps a finite scale


@triton.jit
def _e4m3_codes(y):
    """fp32 y with |y| <= 448 -> e4m3fn codes (uint8), rounded to nearest, ties to even, as torch's cast.

    Normals (|y| >= 2^-6): drop 20 of the 23 mantissa bits with the round-to-nearest-even carry, then
    rebias the exponent (127 -> 7). Subnormals: |y| + 2^14 rounds |y| to a multiple of 2^-9 (the fp32 ulp
    at 2^14), whose low mantissa bits are then the code."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = (tl.abs(y) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    code = tl.where(magnitude >= 0x3C800000, normal, subnormal) | tl.where(bits < 0, 0x80, 0)
    return code.to(tl.uint8)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit patterns (uint16), rounded to nearest, ties to even (torch's rounding)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)


@triton.jit
def _store_fp8_main_row(src_ptr, dst_addr, write, NOPE: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr,
                        NUM_BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr, ROPE_P2: tl.constexpr,
                        SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr):
    """One row src [NOPE + ROPE] (any float dtype) -> the FP8 main row at byte address dst_addr (when write)."""
    dst = dst_addr.to(tl.pointer_type(tl.uint8))
    blocks = tl.arange(0, BLOCKS_P2)
    channels = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [NB, b]
    in_nope = (channels < NOPE) & write
    x = tl.load(src_ptr + channels, mask=in_nope, other=0.0).to(tl.float32)  # [NB, b]
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)  # [NB]
    scale_byte = _pow2_scale_bits(amax)  # [NB] ceil(log2(amax / 448)) + 127
    inverse_scale = ((254 - scale_byte) << 23).to(tl.float32, bitcast=True)  # 2^-(scale_byte - 127), exact
    y = tl.minimum(tl.maximum(x * inverse_scale[:, None], -E4M3_MAX), E4M3_MAX)
    tl.store(dst + channels, _e4m3_codes(y), mask=in_nope)
    lanes = tl.arange(0, ROPE_P2)
    rope = tl.load(src_ptr + NOPE + lanes, mask=(lanes < ROPE) & write, other=0.0).to(tl.float32)  # [P]
    tl.store((dst_addr + NOPE).to(tl.pointer_type(tl.uint16)) + lanes, _bf16_bits(rope), mask=(lanes < ROPE) & write)
    tl.store(dst + SCALE_OFFSET + blocks, scale_byte.to(tl.uint8), mask=(blocks < NUM_BLOCKS) & write)
    pad = SCALE_OFFSET + NUM_BLOCKS + tl.arange(0, 8)  # zeros up to the 8-byte aligned row end
    tl.store(dst + pad, tl.zeros([8], dtype=tl.uint8), mask=(pad < ROW_BYTES) & write)


@triton.jit
def _pow2_scale_bits(amax):
    """amax [..] fp32 (>= 1e-4: a normal number) -> the biased exponent e + 127 of the scale 2^e = the smallest power
    of two >= amax / 448 (exact, from the bits of amax · fp32(1/448) as `qat.pow2_scale_ceil` computes it)."""
    ratio_bits = (amax * (1.0 / E4M3_MAX)).to(tl.int32, bitcast=True)
    return ((ratio_bits >> 23) & 0xFF) + ((ratio_bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _store_fp8_indexer_row(src_ptr, dst_addr, write, DIM: tl.constexpr):
    """One row src [DIM] (any float dtype) -> the FP8 indexer row at byte address dst_addr (when write): DIM e4m3
    codes, then the row's power-of-two scale as an fp32."""
    dst = dst_addr.to(tl.pointer_type(tl.uint8))
    channels = tl.arange(0, DIM)
    x = tl.load(src_ptr + channels, mask=(channels < DIM) & write, other=0.0).to(tl.float32)  # [d]
    scale_byte = _pow2_scale_bits(tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_FLOOR))  # scalar
    inverse_scale = ((254 - scale_byte) << 23).to(tl.float32, bitcast=True)  # 2^-(scale_byte - 127), exact
    y = tl.minimum(tl.maximum(x * inverse_scale, -E4M3_MAX), E4M3_MAX)
    tl.store(dst + channels, _e4m3_codes(y), mask=(channels < DIM) & write)
    scale = (scale_byte << 23).to(tl.float32, bitcast=True)
    tl.store((dst_addr + DIM).to(tl.pointer_type(tl.float32)), scale, mask=write)


def _fp8_row_constants(layout: MainRowBytes, head_dim: int) -> dict:
    check_main_row_layout(layout, head_dim)
    return dict(NOPE=layout.nope_dim, ROPE=layout.rope_dim, BLOCK=layout.block_size, NUM_BLOCKS=layout.num_blocks,
                BLOCKS_P2=triton.next_power_of_2(layout.num_blocks), ROPE_P2=triton.next_power_of_2(layout.rope_dim),
                SCALE_OFFSET=layout.scale_offset, ROW_BYTES=layout.row_bytes)


@triton.jit
def _write_rings_kernel(src_ptr, src2_ptr, dst_like_ptr, token_seq_ptr, positions_ptr, seq_info_ptr, fields_ptr,
                        num_channels, NUM_FIELDS_: tl.constexpr, F_ADDR: tl.constexpr, F_ADDR2: tl.constexpr,
                        F_RING: tl.constexpr, HAS_SECOND: tl.constexpr, DST_BYTES: tl.constexpr,
                        BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
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


@triton.jit
def _write_fp8_ring_kernel(src_ptr, token_seq_ptr, positions_ptr, seq_info_ptr, fields_ptr,
                           NUM_FIELDS_: tl.constexpr, F_ADDR: tl.constexpr, F_RING: tl.constexpr,
                           NOPE: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                           BLOCKS_P2: tl.constexpr, ROPE_P2: tl.constexpr, SCALE_OFFSET: tl.constexpr,
                           ROW_BYTES: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    t = tl.program_id(0)
    b = tl.load(token_seq_ptr + t)
    pos = tl.load(positions_ptr + t)
    chunk_end = tl.load(seq_info_ptr + b * 3) + tl.load(seq_info_ptr + b * 3 + 2)
    fields = fields_ptr + b.to(tl.int64) * NUM_FIELDS_
    ring = tl.load(fields + F_RING)
    write = pos >= chunk_end - ring  # else a later token of the chunk owns this slot
    dst_addr = tl.load(fields + F_ADDR) + (pos % ring) * ROW_BYTES
    _store_fp8_main_row(src_ptr + t.to(tl.int64) * (NOPE + ROPE), dst_addr, write, NOPE, ROPE, BLOCK, NUM_BLOCKS,
                        BLOCKS_P2, ROPE_P2, SCALE_OFFSET, ROW_BYTES)


def write_rings(src: torch.Tensor, ring_like: torch.Tensor, tables: AttentionTables, layer: int,
                address_field: Field, ring_field: Field, *, second: tuple[torch.Tensor, Field] | None = None,
                block_c: int = 512) -> None:
    """src [T, C] -> each token's slot of the ring at `address_field` (size at `ring_field`);
    `second` = (src2 [T, C], its ring's field) writes a same-shaped ring in the same launch (the
    compressor's K and Z). ring_like: any ring of this kind (gives the dtype). The window rings
    (`Field.WINDOW_ADDR`) of FP8 tables (`tables.main_rows`) get FP8 rows, quantized here."""
    if tables.main_rows is not None and address_field is Field.WINDOW_ADDR:
        if second is not None:
            raise ValueError("FP8 window rows are written one ring at a time")
        src = src.contiguous()
        _write_fp8_ring_kernel[(src.shape[0],)](
            src, tables.token_seq, tables.positions, tables.seq_info, tables.layer_fields(layer),
            NUM_FIELDS_=NUM_FIELDS, F_ADDR=int(address_field), F_RING=int(ring_field),
            **_fp8_row_constants(tables.main_rows, src.shape[1]), num_warps=4, **dependent_launch(src.device))
        return
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
                              DST_BYTES=ring_like.element_size(), BLOCK_C=block_c, num_warps=4,
                              **dependent_launch(src.device))


@triton.jit
def pool_channels(kv_ptr, score_ptr, fields, position, chunk_start, chunk_offset, channels, channel_mask, row_dim,
                  RATIO: tl.constexpr, OVERLAP: tl.constexpr, NUM_SLOTS: tl.constexpr, F_KV: tl.constexpr,
                  F_SCORE: tl.constexpr, F_RING: tl.constexpr):
    """The pooled row of the window that the token at `position` closes, at `channels` [BD] -> [BD] fp32 (any
    value where channel_mask is False). Slot inputs at or after chunk_start come from this forward's projected
    inputs kv/score [T, width] (row chunk_offset + pos - chunk_start), earlier ones from the sequence's input
    rings (`fields`: its row of the layer's address table)."""
    window = position // RATIO
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
    return tl.sum(e * kv, axis=0) / tl.sum(e, axis=0)


@triton.jit
def _pool_windows_kernel(kv_ptr, score_ptr, out_ptr, closing_ptr, token_seq_ptr, positions_ptr,
                         seq_info_ptr, fields_ptr, row_dim,
                         RATIO: tl.constexpr, OVERLAP: tl.constexpr, NUM_SLOTS: tl.constexpr,
                         NUM_FIELDS_: tl.constexpr, F_KV: tl.constexpr, F_SCORE: tl.constexpr,
                         F_RING: tl.constexpr, BLOCK_D: tl.constexpr, PREDICATED: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    i = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_mask = channels < row_dim
    t = tl.load(closing_ptr + i)
    b = tl.load(token_seq_ptr + t)
    position = tl.load(positions_ptr + t)
    if PREDICATED:  # every token has a program; only those closing a window pool (others store zeros)
        channel_mask = channel_mask & ((position + 1) % RATIO == 0)
    chunk_start = tl.load(seq_info_ptr + b * 3)
    chunk_offset = tl.load(seq_info_ptr + b * 3 + 1)
    fields = fields_ptr + b.to(tl.int64) * NUM_FIELDS_
    pooled = pool_channels(kv_ptr, score_ptr, fields, position, chunk_start, chunk_offset, channels, channel_mask,
                           row_dim, RATIO, OVERLAP, NUM_SLOTS, F_KV, F_SCORE, F_RING)
    if PREDICATED:
        pooled = tl.where(channel_mask, pooled, 0.0)
        channel_mask = channels < row_dim
    tl.store(out_ptr + i.to(tl.int64) * row_dim + channels, pooled, mask=channel_mask)


def pool_windows(kv: torch.Tensor, score: torch.Tensor, tables: AttentionTables, layer: int,
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
    _pool_windows_kernel[grid](kv.contiguous(), score.contiguous(), out, closing, tables.token_seq,
                               tables.positions, tables.seq_info, tables.layer_fields(layer), row_dim,
                               RATIO=ratio, OVERLAP=overlap, NUM_SLOTS=num_slots, NUM_FIELDS_=NUM_FIELDS,
                               F_KV=int(fields[0]), F_SCORE=int(fields[1]), F_RING=int(fields[2]),
                               BLOCK_D=block_d, PREDICATED=tables.closing_predicated, num_warps=4,
                               **dependent_launch(kv.device))
    return out


@triton.jit
def compressed_row_address(fields_ptr, block_ids_ptr, b, block_stride, rows_per_block, row,
                           NUM_FIELDS_: tl.constexpr, F_ROWS: tl.constexpr, ROW_BYTES):
    """Byte address of compressed row `row` of sequence b (int64) in its store: its own tensor or its block of
    the paged pool (block_ids [B, NB])."""
    block = tl.load(block_ids_ptr + b * block_stride + row // rows_per_block)
    return tl.load(fields_ptr + b * NUM_FIELDS_ + F_ROWS) + (block * rows_per_block + row % rows_per_block) * ROW_BYTES


@triton.jit
def _write_rows_kernel(rows_ptr, dst_like_ptr, closing_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                       row_dim, block_stride, rows_per_block, RATIO: tl.constexpr, NUM_FIELDS_: tl.constexpr,
                       F_ROWS: tl.constexpr, DST_BYTES: tl.constexpr, BLOCK_D: tl.constexpr,
                       PREDICATED: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
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
    addr = compressed_row_address(fields_ptr, block_ids_ptr, b, block_stride, rows_per_block, row, NUM_FIELDS_, F_ROWS,
                                  row_dim * DST_BYTES)
    dst = addr.to(tl.pointer_type(dst_like_ptr.dtype.element_ty))
    values = tl.load(rows_ptr + i.to(tl.int64) * row_dim + channels, mask=mask)
    tl.store(dst + channels, values.to(dst_like_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _closing_row_address(i, closing_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr, block_stride,
                         rows_per_block, RATIO: tl.constexpr, NUM_FIELDS_: tl.constexpr, F_ROWS: tl.constexpr,
                         PREDICATED: tl.constexpr, ROW_BYTES: tl.constexpr):
    """The i-th closing token's compressed row pos // m: (its byte address in the store at field F_ROWS, whether it
    is written)."""
    t = tl.load(closing_ptr + i)
    b = tl.load(token_seq_ptr + t).to(tl.int64)
    position = tl.load(positions_ptr + t)
    row = position // RATIO
    write = position >= 0
    if PREDICATED:  # only tokens closing a window write; the others look up row 0's block (always in the table)
        write = (position + 1) % RATIO == 0
        row = tl.where(write, row, 0)
    addr = compressed_row_address(fields_ptr, block_ids_ptr, b, block_stride, rows_per_block, row, NUM_FIELDS_, F_ROWS,
                                  ROW_BYTES)
    return addr, write


@triton.jit
def _write_fp8_rows_kernel(rows_ptr, closing_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                           block_stride, rows_per_block, RATIO: tl.constexpr, NUM_FIELDS_: tl.constexpr,
                           F_ROWS: tl.constexpr, PREDICATED: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                           BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr,
                           ROPE_P2: tl.constexpr, SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    i = tl.program_id(0)
    dst_addr, write = _closing_row_address(i, closing_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                                           block_stride, rows_per_block, RATIO, NUM_FIELDS_, F_ROWS, PREDICATED,
                                           ROW_BYTES)
    _store_fp8_main_row(rows_ptr + i.to(tl.int64) * (NOPE + ROPE), dst_addr, write, NOPE, ROPE, BLOCK, NUM_BLOCKS,
                        BLOCKS_P2, ROPE_P2, SCALE_OFFSET, ROW_BYTES)


@triton.jit
def _write_fp8_indexer_rows_kernel(rows_ptr, closing_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                                   block_stride, rows_per_block, RATIO: tl.constexpr, NUM_FIELDS_: tl.constexpr,
                                   F_ROWS: tl.constexpr, PREDICATED: tl.constexpr, DIM: tl.constexpr,
                                   ROW_BYTES: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    i = tl.program_id(0)
    dst_addr, write = _closing_row_address(i, closing_ptr, token_seq_ptr, positions_ptr, fields_ptr, block_ids_ptr,
                                           block_stride, rows_per_block, RATIO, NUM_FIELDS_, F_ROWS, PREDICATED,
                                           ROW_BYTES)
    _store_fp8_indexer_row(rows_ptr + i.to(tl.int64) * DIM, dst_addr, write, DIM)


def write_rows(rows: torch.Tensor, dst_like: torch.Tensor, tables: AttentionTables, layer: int, *, ratio: int,
               indexer: bool, block_d: int = 512) -> None:
    """rows [Nc, d] (closing order) -> compressed row pos // m of each closing token's sequence.
    dst_like: a tensor of the stores' dtype; main rows of FP8 tables (`tables.main_rows`) and indexer rows of
    `tables.indexer_rows` are quantized here."""
    closing, num_closing = tables.closing_tokens(ratio)
    if num_closing == 0:
        return
    rows = rows.contiguous()
    which = "indexer" if indexer else "compressor"
    if tables.indexer_rows is not None and indexer:
        check_indexer_row_layout(tables.indexer_rows, rows.shape[1])
        _write_fp8_indexer_rows_kernel[(num_closing,)](
            rows, closing, tables.token_seq, tables.positions, tables.layer_fields(layer), tables.block_ids,
            tables.block_ids.shape[1], tables.rows_per_block(layer, which), RATIO=ratio, NUM_FIELDS_=NUM_FIELDS,
            F_ROWS=int(Field.INDEX_ROWS_ADDR), PREDICATED=tables.closing_predicated, DIM=rows.shape[1],
            ROW_BYTES=tables.indexer_rows.row_bytes, num_warps=1, **dependent_launch(rows.device))
        return
    if tables.main_rows is not None and not indexer:
        _write_fp8_rows_kernel[(num_closing,)](
            rows, closing, tables.token_seq, tables.positions, tables.layer_fields(layer), tables.block_ids,
            tables.block_ids.shape[1], tables.rows_per_block(layer, which), RATIO=ratio, NUM_FIELDS_=NUM_FIELDS,
            F_ROWS=int(Field.ROWS_ADDR), PREDICATED=tables.closing_predicated,
            **_fp8_row_constants(tables.main_rows, rows.shape[1]), num_warps=4, **dependent_launch(rows.device))
        return
    row_dim = rows.shape[1]
    block_d = min(block_d, triton.next_power_of_2(row_dim))
    grid = (num_closing, triton.cdiv(row_dim, block_d))
    _write_rows_kernel[grid](rows, dst_like, closing, tables.token_seq, tables.positions, tables.layer_fields(layer),
                             tables.block_ids, row_dim, tables.block_ids.shape[1], tables.rows_per_block(layer, which),
                             RATIO=ratio, NUM_FIELDS_=NUM_FIELDS,
                             F_ROWS=int(Field.INDEX_ROWS_ADDR if indexer else Field.ROWS_ADDR),
                             DST_BYTES=dst_like.element_size(), BLOCK_D=block_d,
                             PREDICATED=tables.closing_predicated, num_warps=4, **dependent_launch(rows.device))
