"""Interleaved partial RoPE (docs/model.md §2.4), with YaRN frequency scaling on compressed layers.

The rotary part is the trailing `rope_dim` channels of a vector; pairs are adjacent channels
(2i, 2i+1) rotated by angle pos · ω_i (GPT-J / complex convention, not NeoX rotate-half).
Frequencies are computed with the same float32 operations as transformers 5.23.0 so the tables
are bit-identical to it.

On CUDA the rotations run as one Triton launch each (`common.kernels.norm_rope`, dispatch rules in
`common.kernels.glue`), and `rms_norm_rope` / `inverse_rope` fuse the attention projections' glue
(norm then RoPE; the undo of the rotation) into that one launch; `RotaryTable.cos_sin` is one launch,
and `window_rows_norm_rope` (compressed rows) computes its angles inside its norm + RoPE launch. The
torch code is the CPU path and their reference; the kernels' cos and sin are libdevice's, as torch's
CUDA kernels', so the angles' values are the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moemesh.common.kernels.glue import use_triton_glue
from moemesh.common.model.config import ModelConfig, YarnConfig
from moemesh.common.model.linear import rms_norm, unweighted_rms_norm


def inverse_frequencies(rope_dim: int, theta: float, yarn: YarnConfig | None) -> torch.Tensor:
    """ω_i for i in 0..rope_dim/2-1, float32 [rope_dim / 2]."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim
    if yarn is None:
        return 1.0 / (theta**exponents)
    pos_freqs = theta**exponents
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: pair keeps its frequency; 0: pair slowed by `factor`
    return interpolation * (1 - keep) + extrapolation * keep


@dataclass(frozen=True)
class RotaryTable:
    """Frequencies of one RoPE kind ("main": window-only layers; "compress": CSA/HCA layers)."""

    name: str
    rope_dim: int
    inv_freq: torch.Tensor  # [R/2] float32

    @classmethod
    def for_config(cls, config: ModelConfig, compressed: bool) -> "RotaryTable":
        if compressed:
            freqs = inverse_frequencies(config.qk_rope_head_dim, config.compress_rope_theta, config.yarn)
            return cls("compress", config.qk_rope_head_dim, freqs)
        return cls("main", config.qk_rope_head_dim, inverse_frequencies(config.qk_rope_head_dim, config.rope_theta, None))

    def to(self, device) -> "RotaryTable":
        """The same table with its frequencies on `device` (read in place by kernels and captured graphs)."""
        return RotaryTable(self.name, self.rope_dim, self.inv_freq.to(device))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int -> (cos, sin) each [N, R/2] float32; one launch on CUDA."""
        if use_triton_glue(positions, self.inv_freq):
            from moemesh.common.kernels import norm_rope

            return norm_rope.rope_cos_sin(positions, self.inv_freq)
        angles = positions[:, None].float() * self.inv_freq.to(positions.device)
        return angles.cos(), angles.sin()


@dataclass(frozen=True)
class RotaryTables:
    """Several RoPE kinds of one width, their frequencies stacked: every kind's cos/sin of a forward's positions
    in one launch on CUDA (each kind's own `RotaryTable.cos_sin` values)."""

    names: tuple[str, ...]
    inv_freq: torch.Tensor  # [K, R/2] float32

    @classmethod
    def of(cls, tables: Sequence[RotaryTable]) -> "RotaryTables":
        by_name = {table.name: table for table in tables}
        if len({table.inv_freq.shape for table in by_name.values()}) > 1:
            raise ValueError(f"RoPE kinds of different widths: {sorted(by_name)}")
        return cls(tuple(by_name), torch.stack([table.inv_freq.float() for table in by_name.values()]))

    def cos_sin(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """positions [N] int -> {kind: (cos, sin) each [N, R/2] float32}."""
        if use_triton_glue(positions, self.inv_freq):
            from moemesh.common.kernels import norm_rope

            cos, sin = norm_rope.rope_cos_sin(positions, self.inv_freq)  # [K, N, R/2]
            return {name: (cos[k], sin[k]) for k, name in enumerate(self.names)}
        return {name: RotaryTable(name, 2 * self.inv_freq.shape[1], self.inv_freq[k]).cos_sin(positions)
                for k, name in enumerate(self.names)}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2·cos.shape[-1] channels of x in interleaved pairs; pass -sin to undo.

    x [N, ..., C] (any number of middle dims, e.g. heads), cos/sin [N, R/2]. Math in fp32.
    """
    if use_triton_glue(x, cos, sin):
        from moemesh.common.kernels import norm_rope

        return norm_rope.apply_rope(x, cos, sin)
    return _apply_rope_torch(x, cos, sin)


def _apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    rope_dim = 2 * half
    view_shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = cos.view(view_shape)
    sin = sin.view(view_shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = rope.float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def inverse_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope(x, cos, -sin)` (rotate back by the same angles) without materialising -sin."""
    if use_triton_glue(x, cos, sin):
        from moemesh.common.kernels import norm_rope

        return norm_rope.apply_rope(x, cos, sin, inverse=True)
    return _apply_rope_torch(x, cos, -sin)


def rms_norm_rope(
    x: torch.Tensor,  # [N, ..., C]
    cos: torch.Tensor,  # [N, R/2]
    sin: torch.Tensor,  # [N, R/2]
    eps: float,
    weight: torch.Tensor | None = None,  # [C] fp32: RMSNorm's weight; None: unweighted
) -> torch.Tensor:
    """`apply_rope(norm(x), cos, sin)` with norm = RMSNorm(weight) or `unweighted_rms_norm`, one launch on CUDA.

    The attention's q (per-head unweighted norm) and kv (kv_norm) glue; same roundings as the
    two-step torch code, which it runs on CPU.
    """
    if use_triton_glue(x, cos, sin) and (weight is None or use_triton_glue(weight)):
        from moemesh.common.kernels import norm_rope

        kind = norm_rope.NormKind.UNWEIGHTED if weight is None else norm_rope.NormKind.WEIGHTED
        return norm_rope.norm_rope(x, norm=kind, eps=eps, weight=weight, cos=cos, sin=sin)
    normed = unweighted_rms_norm(x, eps) if weight is None else rms_norm(x, weight, eps)
    return _apply_rope_torch(normed, cos, sin)


def window_rows_norm_rope(
    pooled: torch.Tensor,  # [Nc, C] fp32
    weight: torch.Tensor,  # [C] fp32: the compressor's RMSNorm weight
    eps: float,
    table: RotaryTable,
    positions: torch.Tensor,  # [T] int
    tokens: torch.Tensor,  # [Nc] int, flat indices into positions
    ratio: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The compressed rows of the windows that tokens `tokens` close: `rms_norm_rope(pooled.to(dtype))` rotated
    at each window's first position (positions[tokens] // ratio · ratio) -> [Nc, C] dtype. One launch on CUDA,
    the angles computed in it (no cos/sin tensors); same roundings as the torch code, which it runs on CPU."""
    if use_triton_glue(pooled, weight, positions, tokens, table.inv_freq):
        from moemesh.common.kernels import norm_rope

        return norm_rope.window_rows_norm_rope(pooled, weight=weight, eps=eps, inv_freq=table.inv_freq,
                                               positions=positions, tokens=tokens, ratio=ratio, out_dtype=dtype)
    row_positions = torch.div(positions[tokens], ratio, rounding_mode="floor") * ratio  # [Nc]
    cos, sin = table.cos_sin(row_positions)
    return rms_norm_rope(pooled.to(dtype), cos, sin, eps, weight=weight)
