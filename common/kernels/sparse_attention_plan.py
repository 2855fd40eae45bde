"""How a sparse-attention launch (`sparse_attention.py`) is shaped: tile configurations by forward size and the
split of the keys over programs (flash-decoding for grids that would leave SMs idle).

The plan depends only on host figures (tokens, heads, the most keys any token attends to), so static step tables
(services/attention/graph_tables.py) run `plan_splits` on the host for the real step and hand `keys_per_split`
to a captured launch through device memory, while the graph launches the most splits any step of its bucket
can plan (`choose_num_splits` at the bucket's fewest real tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from moemesh.common.kernels.attention_layout import AttentionTables


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Tile sizes; `num_splits` None = chosen from the grid size (`choose_num_splits`)."""

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int | None = None
    target_programs: int = 264  # two waves of 132 SMs
    max_splits: int = 4  # H200 run 3: 4 splits beat 9-20 at B = 1 / 8 (31 vs 40 µs, 33 vs 36 µs, CSA)


# H200 runs 1-2 (docs/performance.md): decode B = 64 best with 16 heads per program and cp.async (108 µs
# CSA, 40 µs HCA; 32 heads: 116 / 48 µs), prefill 8K with 64 (5.0 ms CSA; 32 heads: 1.8x slower in run 1).
DECODE_CONFIG = SparseAttentionConfig(block_h=16, block_n=32, num_warps=8, num_stages=2)
PREFILL_CONFIG = SparseAttentionConfig(block_h=64, block_n=32, num_warps=8, num_stages=1)
# FP8 rows: dequantizing a key block takes registers; 64 heads per program spill (sm_90 ptxas: 792 stack bytes),
# 32 do not (`moemesh bench attention-sass`). Decode's tile does not spill with FP8 rows either. Untimed.
PREFILL_FP8_CONFIG = SparseAttentionConfig(block_h=32, block_n=32, num_warps=8, num_stages=1)
PREFILL_MIN_TOKENS = 256


def default_config(num_tokens: int, fp8_rows: bool = False) -> SparseAttentionConfig:
    if num_tokens < PREFILL_MIN_TOKENS:
        return DECODE_CONFIG
    return PREFILL_FP8_CONFIG if fp8_rows else PREFILL_CONFIG


def choose_num_splits(num_tokens: int, num_head_blocks: int, max_keys: int, config: SparseAttentionConfig) -> int:
    """Enough key splits that the grid fills `target_programs`, each split at least one key block."""
    if config.num_splits is not None:
        return max(1, min(config.num_splits, triton.cdiv(max_keys, config.block_n)))
    programs = num_tokens * num_head_blocks
    if programs >= config.target_programs:
        return 1
    wanted = min(triton.cdiv(config.target_programs, programs), config.max_splits)
    return max(1, min(wanted, triton.cdiv(max_keys, config.block_n)))


@dataclass(frozen=True)
class SplitPlan:
    """How the keys of one launch are split: `num_splits` programs per (token, head block), each over
    `keys_per_split` keys (a multiple of block_n); head blocks of `block_h` heads."""

    block_h: int
    num_head_blocks: int
    num_splits: int
    keys_per_split: int


def plan_splits(num_tokens: int, num_heads: int, max_keys: int, config: SparseAttentionConfig) -> SplitPlan:
    """The split plan of `sparse_attention` for a forward whose tokens see at most `max_keys` keys.
    Static decode tables (services/attention/graph_tables.py) call it on the host with the real
    step's figures and hand `keys_per_split` to a captured launch through device memory."""
    block_h = min(config.block_h, triton.next_power_of_2(num_heads))
    num_head_blocks = triton.cdiv(num_heads, block_h)
    num_splits = choose_num_splits(num_tokens, num_head_blocks, max_keys, config)
    keys_per_split = triton.cdiv(triton.cdiv(max_keys, num_splits), config.block_n) * config.block_n
    return SplitPlan(block_h, num_head_blocks, triton.cdiv(max_keys, keys_per_split), keys_per_split)


def max_keys_of(tables: AttentionTables, window: int, ratio: int, topk: int | None) -> int:
    """Most keys (window + compressed rows) any token of the forward attends to; topk: CSA's K (None: all
    closed rows, HCA; ratio 0: window only)."""
    if not ratio:
        max_rows = 0
    elif topk is not None:
        max_rows = min(topk, tables.max_rows_visible(ratio))
    else:
        max_rows = tables.max_rows_visible(ratio)
    return min(window, tables.max_position + 1) + max_rows
