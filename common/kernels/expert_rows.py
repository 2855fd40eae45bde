"""Rows sorted by expert, as the grouped expert kernels (`fp4_experts`) walk and lay them out.

Legend: R routed rows (sorted by expert), E experts, BE E padded to a power of two, BM rows per tile,
BN output features per tile, C columns of a row.

- `find_tile`: rows of expert e are `offsets[e] : offsets[e+1]`, cut into ceil(rows / BM) row tiles;
  tile `tile_id` finds its expert by a prefix sum over every expert's tile count (one vector load of
  the offsets, no host sync). Tiles past every expert's belong to the rows without an expert
  (`offsets[E] : R`, masked slots), which `store_unrouted_zeros` writes as exact zeros.
- The k-quartered row layout: within each QUARTER_BLOCK-wide block of columns, column 4j + r is
  stored at r·(QUARTER_BLOCK/4) + j, so a reader that takes a K step's columns by k mod 4 (ASM_QUAD's
  four dots) loads each quarter as one contiguous tile. `quartered_columns` maps columns on the
  device, `quarter_columns` is its torch reference over whole rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QUARTER_BLOCK = tl.constexpr(128)  # block width of the k-quartered layout (one ASM_QUAD K step)


@triton.jit
def find_tile(offsets_ptr, tile_id, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row, every expert's tile count) of row tile `tile_id`; expert >= num_experts
    if the tile is past every expert's."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    row_lo = tl.load(offsets_ptr + experts, mask=valid, other=0)  # [BE]
    row_hi = tl.load(offsets_ptr + experts + 1, mask=valid, other=0)  # [BE]
    num_tiles = (row_hi - row_lo + BLOCK_M - 1) // BLOCK_M  # [BE]
    tiles_through = tl.cumsum(num_tiles, 0)  # [BE] inclusive prefix sum
    expert = tl.sum((tiles_through <= tile_id).to(tl.int32), 0)
    mine = experts == expert
    tiles_before = tl.sum(tl.where(mine, tiles_through - num_tiles, 0), 0)
    row_begin = tl.sum(tl.where(mine, row_lo, 0), 0) + (tile_id - tiles_before) * BLOCK_M
    row_end = tl.sum(tl.where(mine, row_hi, 0), 0)
    return expert, row_begin, row_end, tl.sum(num_tiles, 0)


@triton.jit
def store_unrouted_zeros(out_ptr, out_rows_ptr, offsets_ptr, unrouted_tile, pid_n, pid_s, num_experts, num_rows,
                         out_features, stride_or, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zeros into the output rows `out_rows[r]` of tile `unrouted_tile` (counted from the first tile after
    every expert's) of the rows r in [offsets[E], num_rows) (no expert); split-K part 0 only."""
    offs_m = tl.load(offsets_ptr + num_experts) + unrouted_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    mask_m = (offs_m < num_rows) & (pid_s == 0)
    out_rows = tl.load(out_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_rows[:, None] * stride_or + offs_n[None, :], zeros,
             mask=mask_m[:, None] & (offs_n < out_features)[None, :])


@triton.jit
def quartered_columns(cols):
    """Where column `cols` of a row is stored in the k-quartered layout."""
    QUARTER: tl.constexpr = QUARTER_BLOCK // 4
    return (cols // QUARTER_BLOCK) * QUARTER_BLOCK + (cols % 4) * QUARTER + (cols % QUARTER_BLOCK) // 4


def quarter_columns(x: torch.Tensor) -> torch.Tensor:
    """[R, C] -> [R, C] in the k-quartered layout (C a multiple of QUARTER_BLOCK): the torch reference."""
    num_rows, num_cols = x.shape
    block = QUARTER_BLOCK.value
    return x.reshape(num_rows, num_cols // block, block // 4, 4).transpose(2, 3).reshape(num_rows, num_cols)
