"""Launch configurations of the grouped expert kernels (`fp4_experts`) and the default choice.

Legend: R routed rows, E experts, BM rows per tile, BN output features per tile, BK input
features per K step, S split-K parts.

The default (`choose_grouped_config`) is a table of the best configurations measured on an H200
per launch (gate-up or down) and per bucket of mean rows per expert; the figures it cites are in
docs/performance.md and the result files named there. Variants exist so that one benchmark run can
sweep them (`bench/kernels.py`); each one is correct everywhere it is accepted (`validate`).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from moemesh.common.kernels.reference import FP4_BLOCK_SIZE, FP8_BLOCK_SIZE


class Fp4Decode(enum.IntEnum):
    """How a K step of FP4 weights meets the activations.

    JOIN: decode both nibbles to fp32, interleave them into [BN, BK] (tl.join + reshape), one dot.
    HALVES: decode even-k and odd-k nibbles into two [BN, BK/2] tiles, split x the same way
      (a register-only de-interleave), two dots; no interleaving of the weight tile.
    DOT_SCALED: hand the raw bytes and scale bytes to `tl.dot_scaled` (Triton's own e2m1 upcast on
      Hopper); bf16 activations only, compiled kernels only (the interpreter lacks it).
    FMA: HALVES' decode, then fp32 multiply-add and a reduction over k instead of a dot: no
      tensor-core operand layout at all; meant for one to a few rows per tile (decode).
    ASM: HALVES with the decode in inline PTX, four bytes per call straight to bf16x2
      (`dequant_tiles.fp4_tile_halves_bf16_asm`); bf16 activations, compiled kernels only.
    ASM_FOLDED: ASM with the 2^126 bias folded into a per-element bf16x2 scale (one multiply per
      pair); the accumulators carry W * 2^-16 and are rescaled after the K loop. Exact for scale
      bytes 18..144 (real checkpoints use ~110..130).
    ASM_QUAD: ASM_FOLDED reading the codes as uint16 (4 codes each) into four [BN, BK/4] tiles by
      k mod 4, so no byte packing precedes the PTX; x split four ways, four dots. Same range.
      Its scale bytes are prefetched one K step ahead in registers.
    ASM_QUAD_WORD_SCALES: ASM_QUAD reading the scale bytes as 32-bit words inside the step, left
      to Triton's pipeliner (staged with the weights); block_k a multiple of 128.
    """

    JOIN = 0
    HALVES = 1
    DOT_SCALED = 2
    FMA = 3
    ASM = 4
    ASM_FOLDED = 5
    ASM_QUAD = 6
    ASM_QUAD_WORD_SCALES = 7


GPU_ONLY_DECODES = (Fp4Decode.DOT_SCALED, Fp4Decode.ASM, Fp4Decode.ASM_FOLDED, Fp4Decode.ASM_QUAD,
                    Fp4Decode.ASM_QUAD_WORD_SCALES)


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tile shape and launch parameters; `block_k` is a power-of-two multiple of 32 (FP8 weights:
    at most 128, so that a K step stays inside one 128-wide scale block).

    `split_k` > 1 cuts each tile's K loop over that many programs (single launch, fix-up by the
    last program: `split_k.py`); the number of K steps must be a multiple of it.
    For FP8 weights `fp4_decode` selects FMA (multiply-add), ASM_QUAD (inline-PTX e4m3 decode by
    k mod 4, `dequant_tiles.fp8_tile_quarters_bf16_asm`) or, for JOIN and HALVES, the fp32 tile and
    one dot; the other modes are refused.
    """

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    fp4_decode: Fp4Decode = Fp4Decode.JOIN

    def __post_init__(self) -> None:
        if self.block_k % FP4_BLOCK_SIZE != 0 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k {self.block_k} must be a power of two and a multiple of 32")
        min_m = 1 if self.fp4_decode == Fp4Decode.FMA else 16
        if self.block_m < min_m or self.block_n < 16:
            raise ValueError(f"block_m must be at least {min_m} and block_n at least 16 (tl.dot)")
        if self.block_m & (self.block_m - 1):
            raise ValueError("block_m must be a power of two")
        if self.split_k < 1:
            raise ValueError("split_k must be >= 1")

    def short(self) -> str:
        """Compact label for benchmark tables: `m16n64k128w4s3 halves S4`."""
        split = f" S{self.split_k}" if self.split_k > 1 else ""
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages} "
                f"{self.fp4_decode.name.lower()}{split}")


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def validate(config: GroupedGemmConfig, *, in_features: int, is_fp4: bool, x_is_bf16: bool) -> None:
    """Raise ValueError where a config cannot run this launch (rather than compute garbage)."""
    if not is_fp4 and FP8_BLOCK_SIZE % config.block_k != 0:
        raise ValueError(f"FP8 weights need block_k dividing {FP8_BLOCK_SIZE}, got {config.block_k}")
    if in_features % config.block_k != 0:
        raise ValueError(f"in_features {in_features} must be a multiple of block_k {config.block_k}")
    if (in_features // config.block_k) % config.split_k != 0:
        raise ValueError(f"{in_features // config.block_k} K steps do not split into {config.split_k}")
    if is_fp4 and config.fp4_decode == Fp4Decode.ASM_QUAD_WORD_SCALES and config.block_k % 128:
        raise ValueError("ASM_QUAD_WORD_SCALES reads 4 scale bytes per word: block_k must be a multiple of 128")
    if not is_fp4 and config.fp4_decode not in (Fp4Decode.ASM_QUAD, Fp4Decode.FMA, Fp4Decode.JOIN, Fp4Decode.HALVES):
        raise ValueError(f"{config.fp4_decode.name} has no FP8 form (FP8 weights take JOIN, FMA or ASM_QUAD)")
    if config.fp4_decode in GPU_ONLY_DECODES and (is_fp4 or config.fp4_decode == Fp4Decode.ASM_QUAD):
        if not x_is_bf16:
            raise ValueError(f"{config.fp4_decode.name} needs bf16 activations")
        if interpreter_active():
            raise ValueError(f"{config.fp4_decode.name} is not available under TRITON_INTERPRET=1")


DEFAULT_NUM_SMS = 132  # H200 / H100 SXM
SPLIT_K_MAX_PROGRAMS = 2 * DEFAULT_NUM_SMS
TALL_TILE_MIN_MEAN_ROWS = 96  # prefill: 128-row tiles from this many rows per expert (see choose_grouped_config)


def choose_grouped_config(num_rows: int, num_experts: int, *, out_features: int = 2048, x_is_bf16: bool = True,
                          is_fp4: bool = True, num_sms: int = DEFAULT_NUM_SMS) -> GroupedGemmConfig:
    """The default launch configuration: the best measured on an H200 per bucket of rows per expert.

    Measured (µs, gate-up / down, V4-Flash 256 experts × 4096 × 2048, CUDA-graph replays, weights
    from HBM; docs/performance.md, results kernels-fp4-T*-20261129T1955*Z.json):

    | rows (tokens × 6) | JOIN | HALVES | ASM_QUAD (default) |
    |---|---|---|---|
    | 6 (1 token)       | 89.2 / 35.7   | 78.3 / 34.7   | 51.3 / 29.0      |
    | 384 (64 tokens)   | 1627 / 800    | 1462 / 778    | 1132 / 596       |
    | 12288 (2048 tok.) | 2566 / 1254   | 2637 / 1430   | 2199 / 1160      |
    | 49152 (8192 tok.) |               |               | 7643 / 4056 (64-row tiles); 6307 / 3181 (128-row, default) |

    ASM_QUAD needs bf16 activations and compiled kernels, and is exact for scale bytes 18..144
    (a byte above 144 would overflow bf16; below 18 the weight, < 6 * 2^-109, underflows towards
    0; checkpoints hold ~110..130, their quantizer floors amax at 1e-4); elsewhere (fp32 activations, the CPU
    interpreter) the portable decode takes its place: HALVES in decode, JOIN in prefill (the
    faster of the two there). Split-K 2 when the launch would otherwise have fewer programs than
    two per SM (a single token's gate-up: 6 row tiles × 32 column tiles); the row-tile count is
    only known on the device, so the host uses its upper bound min(R, ceil(R / BM) + E).
    """
    gpu_decode = x_is_bf16 and is_fp4 and not interpreter_active()  # FP8 weights: fp32 tile + dot (measured)
    mean_rows_per_expert = num_rows / max(1, num_experts)
    if mean_rows_per_expert >= 32:  # prefill
        decode = Fp4Decode.ASM_QUAD if gpu_decode else Fp4Decode.JOIN
        # 128-row tiles decode each weight tile for twice the rows: at 49,152 rows (8K tokens, ~192 per
        # expert) gate-up / down 7643 / 4056 -> 6307 / 3181 µs; at 12,288 rows (~48 per expert, tiles mostly
        # empty) 2187 / 1154 -> 3206 / 1573 µs (docs/performance.md). The switch point between
        # the two measured sizes is an interpolation: one 128-row tile costs ~1.4 64-row tiles.
        block_m = 128 if mean_rows_per_expert >= TALL_TILE_MIN_MEAN_ROWS and gpu_decode else 64
        return GroupedGemmConfig(block_m=block_m, block_n=128, block_k=64, num_warps=8, num_stages=3,
                                 fp4_decode=decode)
    block_m = 16 if mean_rows_per_expert <= 4 else 32
    block_n, block_k = 64, 128
    decode = Fp4Decode.ASM_QUAD if gpu_decode else Fp4Decode.HALVES
    max_row_tiles = min(num_rows, -(-num_rows // block_m) + num_experts)
    num_programs = max_row_tiles * -(-out_features // block_n)
    split_k = 2 if num_programs <= 2 * num_sms else 1
    return GroupedGemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=3,
                             split_k=split_k, fp4_decode=decode)
