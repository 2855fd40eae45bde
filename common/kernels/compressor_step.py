"""A decode step's compressor work in one launch: the compressor's and the indexer compressor's new inputs into
their rings, and the rows of the windows this step closes, pooled, normed, rotated and stored.

What `kv_write.pool_windows`, `norm_rope.window_rows_norm_rope`, `kv_write.write_rows` and
`kv_write.write_rings` do in four launches per compressor (eight for a CSA layer), for forwards of a few
tokens per sequence (decode, speculative verification):
- grid (sequence b, compressor c, channel block j): each program pools, for every window its sequence's chunk
  closes, the channels of block j (`kv_write.pool_channels`) into a fp32 scratch row, then writes the same
  columns of the chunk's last `ring` inputs into the input rings. The pooling of block j reads only block j's
  ring columns (both halves with overlap), so no program overwrites what another still reads;
- the last program of (b, c) to take a ticket (`split_k.take_ticket`) norms and rotates each closed row at its
  window's first position and stores it: straight into a bf16 row store, or through a bf16 scratch row into
  the FP8 main-row layout (`tables.main_rows`) or the FP8 indexer-row layout (`tables.indexer_rows`).
A step in which no window closes only writes the rings. Same values as the four launches: the same pooling
order per channel block, the same norm and rotation code (`norm_rope._norm_rope_row`), the same FP8 packing.
The FP8 QAT of rows stored in the activation dtype is not done here (`applies` says so; its callers take the
four launches).
Legend: B sequences, T tokens, d row dim, m ratio, NS pooling slots, BD channels per program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.attention_layout import NUM_FIELDS, AttentionTables, Field, check_indexer_row_layout
from moemesh.common.kernels.dependent_launch import dependent_launch, wait_for_inputs
from moemesh.common.kernels.kv_write import (
    _fp8_row_constants, _store_fp8_indexer_row, _store_fp8_main_row, compressed_row_address, pool_channels,
)
from moemesh.common.kernels.norm_rope import _norm_rope_row
from moemesh.common.kernels.split_k import take_ticket, tile_counters

MAX_STEP_TOKENS = 64  # longer forwards (prefill chunks) take the per-row launches, which spread over the rows


@dataclass(frozen=True)
class CompressorStep:
    """One compressor's part of the launch: this forward's projected inputs and its norm."""

    kv: torch.Tensor  # [T, width] (width = 2d with overlap, else d)
    score: torch.Tensor  # [T, width] fp32
    norm_weight: torch.Tensor  # [d] fp32
    eps: float
    ratio: int
    overlap: bool
    row_dim: int
    indexer: bool  # the indexer's compressor (its own rings and rows)


def applies(tables: AttentionTables, num_tokens: int, qat_main: bool, qat_indexer: bool = False) -> bool:
    """Whether a forward of num_tokens takes the one-launch step: few tokens, and no FP8 QAT (`qat_main`,
    `qat_indexer`: the layer's and the indexer's compressor simulate FP8 rows) of rows stored in the activation
    dtype (FP8-stored rows are quantized by the store itself, to the values the simulation gives)."""
    return (0 < num_tokens <= MAX_STEP_TOKENS and (not qat_main or tables.main_rows is not None)
            and (not qat_indexer or tables.indexer_rows is not None))


def pooling_block(ratio: int, overlap: bool, row_dim: int) -> tuple[int, int]:
    """(pooling slots, channels per program): `kv_write.pool_windows`'s choice, so the pooled values are its."""
    num_slots = triton.next_power_of_2((2 if overlap else 1) * ratio)
    return num_slots, min(max(16, 2048 // num_slots), triton.next_power_of_2(row_dim))


@triton.jit
def _compress(b, channel_block, kv_ptr, score_ptr, weight_ptr, pooled_ptr, normed_ptr, rows_like_ptr, inv_freq_ptr,
              seq_info_ptr, fields_ptr, block_ids_ptr, block_stride, rows_per_block, counter_ptr, eps, rope_half,
              ROW_DIM: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, NUM_SLOTS: tl.constexpr,
              BLOCK_D: tl.constexpr, NUM_CHANNEL_BLOCKS: tl.constexpr, F_KV: tl.constexpr, F_SCORE: tl.constexpr,
              F_RING: tl.constexpr, F_ROWS: tl.constexpr, NUM_FIELDS_: tl.constexpr, BLOCK_C: tl.constexpr,
              BLOCK_H: tl.constexpr, STORE_ROW_BYTES: tl.constexpr, ROW_FORMAT: tl.constexpr, NOPE: tl.constexpr,
              ROPE: tl.constexpr,
              BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr, ROPE_P2: tl.constexpr,
              SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr):
    """Program (b, channel_block) of one compressor (see the module docstring)."""
    if channel_block < NUM_CHANNEL_BLOCKS:
        chunk_start = tl.load(seq_info_ptr + b * 3)
        chunk_offset = tl.load(seq_info_ptr + b * 3 + 1)
        chunk_len = tl.load(seq_info_ptr + b * 3 + 2)
        fields = fields_ptr + b * NUM_FIELDS_
        channels = channel_block * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
        channel_mask = channels < ROW_DIM
        first_row = chunk_start // RATIO  # window w is closed by the token at position (w + 1)·m - 1
        end_row = (chunk_start + chunk_len) // RATIO
        zero = chunk_start * 0  # an int64 zero: loop counters are plain ints under the interpreter
        for w in range(first_row, end_row):
            position = zero + (w + 1) * RATIO - 1
            t = chunk_offset + position - chunk_start
            pooled = pool_channels(kv_ptr, score_ptr, fields, position, chunk_start, chunk_offset, channels,
                                   channel_mask, ROW_DIM, RATIO, OVERLAP, NUM_SLOTS, F_KV, F_SCORE, F_RING)
            tl.store(pooled_ptr + t * ROW_DIM + channels, pooled, mask=channel_mask)
        # this block's ring columns, after its pooling read them: the chunk's last `ring` inputs
        if OVERLAP:
            width = 2 * ROW_DIM
        else:
            width = ROW_DIM
        ring = tl.load(fields + F_RING)
        ring_kv = tl.load(fields + F_KV).to(tl.pointer_type(tl.float32))
        ring_score = tl.load(fields + F_SCORE).to(tl.pointer_type(tl.float32))
        for j in range(tl.maximum(chunk_len - ring, 0), chunk_len):
            t = chunk_offset + j
            slot = ((chunk_start + j) % ring) * width
            tl.store(ring_kv + slot + channels, tl.load(kv_ptr + t * width + channels, mask=channel_mask).to(
                tl.float32), mask=channel_mask)
            tl.store(ring_score + slot + channels, tl.load(score_ptr + t * width + channels, mask=channel_mask),
                     mask=channel_mask)
            if OVERLAP:
                tl.store(ring_kv + slot + ROW_DIM + channels, tl.load(
                    kv_ptr + t * width + ROW_DIM + channels, mask=channel_mask).to(tl.float32), mask=channel_mask)
                tl.store(ring_score + slot + ROW_DIM + channels, tl.load(
                    score_ptr + t * width + ROW_DIM + channels, mask=channel_mask), mask=channel_mask)
        if end_row > first_row:
            if take_ticket(counter_ptr, NUM_CHANNEL_BLOCKS):  # every block of the closed rows is pooled
                pairs = tl.arange(0, BLOCK_H)
                inv_freq = tl.load(inv_freq_ptr + pairs, mask=pairs < rope_half, other=0.0)
                for w in range(first_row, end_row):
                    w = zero + w
                    t = chunk_offset + (w + 1) * RATIO - 1 - chunk_start
                    angles = (w * RATIO).to(tl.float32) * inv_freq  # [BH] at the window's first position
                    row_addr = compressed_row_address(fields_ptr, block_ids_ptr, b, block_stride, rows_per_block, w,
                                                      NUM_FIELDS_, F_ROWS, STORE_ROW_BYTES)
                    if ROW_FORMAT != 0:  # FP8: normed into a scratch row in the activation dtype, then packed
                        _norm_rope_row(pooled_ptr + t * ROW_DIM, normed_ptr + t * ROW_DIM, weight_ptr, tl.cos(angles),
                                       tl.sin(angles), ROW_DIM, rope_half, eps, 2, True, False, BLOCK_C, BLOCK_H)
                        tl.debug_barrier()
                        if ROW_FORMAT == 1:
                            _store_fp8_main_row(normed_ptr + t * ROW_DIM, row_addr, w >= 0, NOPE, ROPE, BLOCK,
                                                NUM_BLOCKS, BLOCKS_P2, ROPE_P2, SCALE_OFFSET, ROW_BYTES)
                        else:
                            _store_fp8_indexer_row(normed_ptr + t * ROW_DIM, row_addr, w >= 0, ROW_DIM)
                    else:
                        _norm_rope_row(pooled_ptr + t * ROW_DIM,
                                       row_addr.to(tl.pointer_type(rows_like_ptr.dtype.element_ty)), weight_ptr,
                                       tl.cos(angles), tl.sin(angles), ROW_DIM, rope_half, eps, 2, True, False,
                                       BLOCK_C, BLOCK_H)


@triton.jit
def _compressor_step_kernel(
        kv0_ptr, score0_ptr, weight0_ptr, pooled0_ptr, normed0_ptr, rows0_like_ptr, rows_per_block0, eps0,
        kv1_ptr, score1_ptr, weight1_ptr, pooled1_ptr, normed1_ptr, rows1_like_ptr, rows_per_block1, eps1,
        inv_freq_ptr, seq_info_ptr, fields_ptr, block_ids_ptr, block_stride, counters_ptr, rope_half,
        RATIO: tl.constexpr, OVERLAP: tl.constexpr, NUM_SLOTS: tl.constexpr, NUM_FIELDS_: tl.constexpr,
        ROW_DIM0: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCKS0: tl.constexpr, BLOCK_C0: tl.constexpr,
        STORE_ROW_BYTES0: tl.constexpr,
        ROW_DIM1: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCKS1: tl.constexpr, BLOCK_C1: tl.constexpr,
        STORE_ROW_BYTES1: tl.constexpr,
        F_KV0: tl.constexpr, F_SCORE0: tl.constexpr, F_RING0: tl.constexpr, F_ROWS0: tl.constexpr,
        F_KV1: tl.constexpr, F_SCORE1: tl.constexpr, F_RING1: tl.constexpr, F_ROWS1: tl.constexpr,
        BLOCK_H: tl.constexpr, ROW_FORMAT0: tl.constexpr, ROW_FORMAT1: tl.constexpr, NOPE: tl.constexpr,
        ROPE: tl.constexpr,
        BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr, ROPE_P2: tl.constexpr,
        SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    # grid (B, compressors, channel blocks); compressor 0 the layer's, 1 the indexer's (CSA)
    b = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    channel_block = tl.program_id(2)
    counter_ptr = counters_ptr + b * 2 + which
    if which == 0:
        _compress(b, channel_block, kv0_ptr, score0_ptr, weight0_ptr, pooled0_ptr, normed0_ptr, rows0_like_ptr,
                  inv_freq_ptr, seq_info_ptr, fields_ptr, block_ids_ptr, block_stride, rows_per_block0, counter_ptr,
                  eps0, rope_half, ROW_DIM0, RATIO, OVERLAP, NUM_SLOTS, BLOCK_D0, BLOCKS0, F_KV0, F_SCORE0, F_RING0,
                  F_ROWS0, NUM_FIELDS_, BLOCK_C0, BLOCK_H, STORE_ROW_BYTES0, ROW_FORMAT0, NOPE, ROPE, BLOCK, NUM_BLOCKS, BLOCKS_P2,
                  ROPE_P2, SCALE_OFFSET, ROW_BYTES)
    else:
        _compress(b, channel_block, kv1_ptr, score1_ptr, weight1_ptr, pooled1_ptr, normed1_ptr, rows1_like_ptr,
                  inv_freq_ptr, seq_info_ptr, fields_ptr, block_ids_ptr, block_stride, rows_per_block1, counter_ptr,
                  eps1, rope_half, ROW_DIM1, RATIO, OVERLAP, NUM_SLOTS, BLOCK_D1, BLOCKS1, F_KV1, F_SCORE1, F_RING1,
                  F_ROWS1, NUM_FIELDS_, BLOCK_C1, BLOCK_H, STORE_ROW_BYTES1, ROW_FORMAT1, NOPE, ROPE, BLOCK, NUM_BLOCKS, BLOCKS_P2, ROPE_P2,
                  SCALE_OFFSET, ROW_BYTES)


def _row_format(tables: AttentionTables, step: CompressorStep) -> tuple[int, int]:
    """(row format: 0 the activation dtype, 1 the FP8 main row, 2 the FP8 indexer row; bytes per stored row)."""
    if step.indexer and tables.indexer_rows is not None:
        check_indexer_row_layout(tables.indexer_rows, step.row_dim)
        return 2, tables.indexer_rows.row_bytes
    if not step.indexer and tables.main_rows is not None:
        return 1, tables.main_rows.row_bytes
    return 0, step.row_dim * tables.state_dtype.itemsize


_FIELDS = {False: (Field.INPUT_KV_ADDR, Field.INPUT_SCORE_ADDR, Field.INPUT_RING, Field.ROWS_ADDR),
           True: (Field.INDEX_INPUT_KV_ADDR, Field.INDEX_INPUT_SCORE_ADDR, Field.INDEX_INPUT_RING,
                  Field.INDEX_ROWS_ADDR)}


def compressor_step(steps: tuple[CompressorStep, ...], tables: AttentionTables, layer: int,
                    inv_freq: torch.Tensor) -> None:
    """One launch for the layer's compressor (steps[0]) and, on CSA layers, the indexer's (steps[1]): ring writes
    and the rows of the windows this forward closes (see the module docstring). inv_freq [R/2] fp32: the
    compressed rows' rotary frequencies."""
    if not 1 <= len(steps) <= 2 or steps[0].indexer or (len(steps) == 2 and not steps[1].indexer):
        raise ValueError("one compressor step, or the layer's then the indexer's")
    if len({(step.ratio, step.overlap) for step in steps}) != 1:
        raise ValueError("the two compressors of a layer share ratio and overlap")
    first = steps[0]
    num_slots, _ = pooling_block(first.ratio, first.overlap, first.row_dim)
    num_sequences = tables.seq_info.shape[0]
    device = first.kv.device
    fp8 = (_fp8_row_constants(tables.main_rows, first.row_dim) if tables.main_rows is not None else
           dict(NOPE=1, ROPE=1, BLOCK=1, NUM_BLOCKS=1, BLOCKS_P2=1, ROPE_P2=1, SCALE_OFFSET=0, ROW_BYTES=0))
    args, constants = [], {}
    for index, step in enumerate(steps + steps[:1] * (2 - len(steps))):  # an absent second: the first, no programs
        num_tokens, width = step.kv.shape
        if width != (2 if step.overlap else 1) * step.row_dim or step.score.shape != step.kv.shape:
            raise ValueError(f"inputs {tuple(step.kv.shape)} / {tuple(step.score.shape)} do not fit row_dim "
                             f"{step.row_dim} (overlap {step.overlap})")
        row_format, row_bytes = _row_format(tables, step)
        _, block_d = pooling_block(step.ratio, step.overlap, step.row_dim)
        pooled = torch.empty(num_tokens, step.row_dim, dtype=torch.float32, device=device)
        normed = torch.empty(num_tokens, step.row_dim, dtype=tables.state_dtype, device=device) if row_format else pooled
        which = "indexer" if step.indexer else "compressor"
        args += [step.kv.contiguous(), step.score.contiguous(), step.norm_weight.contiguous(), pooled, normed,
                 torch.empty(0, dtype=tables.state_dtype, device=device), tables.rows_per_block(layer, which),
                 float(step.eps)]
        fields = _FIELDS[step.indexer]
        constants.update({f"ROW_DIM{index}": step.row_dim, f"BLOCK_D{index}": block_d,
                          f"BLOCKS{index}": triton.cdiv(step.row_dim, block_d) if index < len(steps) else 0,
                          f"BLOCK_C{index}": triton.next_power_of_2(step.row_dim), f"F_KV{index}": int(fields[0]),
                          f"F_SCORE{index}": int(fields[1]), f"F_RING{index}": int(fields[2]),
                          f"F_ROWS{index}": int(fields[3]), f"STORE_ROW_BYTES{index}": row_bytes,
                          f"ROW_FORMAT{index}": row_format})
    rope_half = inv_freq.shape[0]
    grid = (num_sequences, len(steps), max(constants["BLOCKS0"], constants["BLOCKS1"]))
    _compressor_step_kernel[grid](
        *args, inv_freq.float().contiguous(), tables.seq_info, tables.layer_fields(layer), tables.block_ids,
        tables.block_ids.shape[1], tile_counters(device, 2 * num_sequences), rope_half,
        RATIO=first.ratio, OVERLAP=first.overlap, NUM_SLOTS=num_slots, NUM_FIELDS_=NUM_FIELDS,
        BLOCK_H=triton.next_power_of_2(rope_half), **constants, **fp8, num_warps=4, **dependent_launch(device))
