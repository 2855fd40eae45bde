"""The schedule of an FP8 linear launch (`fp8_linear.py`): its tile configuration, chosen by forward size.

- decode (T <= 64): narrow N tiles and split-K, so that there are at least ~2 programs per SM and each weight
  byte is read once;
- prefill: 128x128 output tiles over the full K, no split; measured tile choices by N.
The inline-PTX e4m3 decode is switched on per bucket where it measured faster (`PTX_DECODE_BY_DEFAULT`).
Legend: T tokens, N output features, K input features.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton

from moemesh.common.kernels.reference import FP8_BLOCK_SIZE

DECODE_MAX_TOKENS = 64
DEFAULT_NUM_SMS = 132  # H200/H100 SXM; used when no CUDA device answers (the interpreter)

@dataclass(frozen=True)
class Fp8LinearConfig:
    """Tile shape and launch parameters. `block_k` must divide 128 (one scale per K step)."""

    block_n: int
    block_t: int
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_fma: bool = False  # fp32 multiply-add + reduction over k instead of tl.dot (GEMV, block_t >= 1)
    asm_decode: bool = False  # e4m3 -> bf16 by inline PTX (GPU only, bf16 x, tl.dot; `dequant_tiles.fp8_tile_bf16_asm`)
    asm_quad: bool = False  # with asm_decode: codes read as uint32, four dots by k mod 4 (`fp8_tile_quarters_bf16_asm`)

    def __post_init__(self) -> None:
        if FP8_BLOCK_SIZE % self.block_k != 0:
            raise ValueError(f"block_k {self.block_k} must divide {FP8_BLOCK_SIZE}")
        min_t = 1 if self.use_fma else 16
        if min(self.block_n, self.block_k) < 16 or self.block_t < min_t:
            raise ValueError(f"block_n and block_k must be at least 16, block_t at least {min_t} (tl.dot)")
        if self.block_t & (self.block_t - 1):
            raise ValueError("block_t must be a power of two")
        if self.asm_decode and self.use_fma:
            raise ValueError("asm_decode feeds tl.dot; it does not combine with use_fma")
        if self.split_k < 1:
            raise ValueError("split_k must be >= 1")


@functools.lru_cache(maxsize=16)
def device_num_sms(device: torch.device) -> int:
    """Cached: the property query costs tens of microseconds, more than a decode-size kernel."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


# Whether the inline-PTX e4m3 decode (asm_decode + asm_quad) is the default, per bucket, where it
# can run (bf16 activations, compiled kernels, K a multiple of 4). Measured on an H200
# (kernels-fp8-h200x2-20261129T212201Z.json, docs/performance.md): decode T=64 equal or 3-9 % faster on all six
# V4-Flash shapes, T=1 2-5 % faster on four (wq_a 5.8 -> 6.1 us slower); prefill T=2048 8-65 % slower.
PTX_DECODE_BY_DEFAULT = {"decode": True, "prefill": False}


def choose_fp8_linear_config(
    num_tokens: int, out_features: int, in_features: int, num_sms: int = DEFAULT_NUM_SMS, *,
    ptx_decode_possible: bool = False,
) -> Fp8LinearConfig:
    """Heuristic schedule; see the module docstring. Benchmarked alternatives live in bench/kernels.py."""
    config = _heuristic_tiles(num_tokens, out_features, in_features, num_sms)
    bucket = "prefill" if num_tokens > DECODE_MAX_TOKENS else "decode"
    if ptx_decode_possible and PTX_DECODE_BY_DEFAULT[bucket]:
        config = dataclasses.replace(config, asm_decode=True, asm_quad=True)
    return config


def _heuristic_tiles(num_tokens: int, out_features: int, in_features: int, num_sms: int) -> Fp8LinearConfig:
    if num_tokens > DECODE_MAX_TOKENS:
        # Measured on an H200 at T=2048 (docs/performance.md): BK=64 with 4 stages wins from N=2048 up;
        # N<=512 needs narrower tiles to fill the SMs.
        if out_features <= 512:
            return Fp8LinearConfig(block_n=64, block_t=128, block_k=128, split_k=1, num_warps=4, num_stages=4)
        if out_features >= 2048:
            return Fp8LinearConfig(block_n=128, block_t=128, block_k=64, split_k=1, num_warps=8, num_stages=4)
        return Fp8LinearConfig(block_n=128, block_t=128, block_k=128, split_k=1, num_warps=8, num_stages=3)
    block_t = max(16, triton.next_power_of_2(num_tokens))
    block_n = 64
    num_n_tiles = triton.cdiv(out_features, block_n)
    num_k_steps = triton.cdiv(in_features, 128)
    wanted_split = max(1, min(num_k_steps, triton.cdiv(2 * num_sms, num_n_tiles)))
    k_steps_per_split = triton.cdiv(num_k_steps, wanted_split)
    split_k = triton.cdiv(num_k_steps, k_steps_per_split)  # no empty split
    return Fp8LinearConfig(block_n=block_n, block_t=block_t, block_k=128, split_k=split_k, num_warps=4, num_stages=4)
