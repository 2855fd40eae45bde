"""A linear followed by its RMS norm and / or RoPE per group of output columns: the attention projections' glue.

    y = linear(x) [T, N], viewed [T, N / G, G]; each group: RMSNorm (with a weight, or unweighted), then RoPE
    of its trailing 2·R/2 channels by the token's (cos, sin) [T, R/2].

Where `linear` is an FP8 linear on its decode kernel (CUDA, T <= `fp8_linear_config.DECODE_MAX_TOKENS`) the norm and
rotation run in the linear's launch (`fp8_linear.RowNorm`: the last tile of each group normalises it); everywhere
else the linear, then `rms_norm` / `rms_norm_rope` / `apply_rope` (one fused glue launch on CUDA, the torch
code on the CPU, which stays the reference). Same roundings either way; on the GPU the fp32 sum of squares may
be ordered differently.
Legend: T tokens, N out features, G group (columns normalised together), R rotary channels.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.common.kernels.glue import torch_glue_forced
from moemesh.common.model.linear import rms_norm, unweighted_rms_norm
from moemesh.common.model.rope import apply_rope, rms_norm_rope


def linear_norm_rope(linear: nn.Module, x: torch.Tensor, *, group: int, norm: bool, eps: float = 0.0,
                     weight: torch.Tensor | None = None, cos: torch.Tensor | None = None,
                     sin: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> [T, N]: `linear(x)` with, per group of `group` columns, RMSNorm when `norm` (weighted by
    `weight` [G] fp32 when given, unweighted else) and RoPE with (cos, sin) [T, R/2] when given."""
    fused = _fused(linear, x, group, norm, eps, weight, cos, sin)
    if fused is not None:
        return fused
    y = linear(x)  # [T, N]
    num_tokens, num_out = y.shape
    grouped = y if group == num_out else y.view(num_tokens, num_out // group, group)  # [T, (N/G,) G]
    if cos is not None and norm:
        out = rms_norm_rope(grouped, cos, sin, eps, weight=weight)
    elif cos is not None:
        out = apply_rope(grouped, cos, sin)
    elif norm:
        out = rms_norm(grouped, weight, eps) if weight is not None else unweighted_rms_norm(grouped, eps)
    else:
        out = grouped
    return out.reshape(num_tokens, num_out)


def _fused(linear: nn.Module, x: torch.Tensor, group: int, norm: bool, eps: float, weight, cos, sin
           ) -> torch.Tensor | None:
    """The one-launch form, or None where the unfused path runs."""
    from moemesh.common.model.quantized import Fp8Linear, _use_kernel

    if type(linear) is not Fp8Linear or x.dim() != 2 or not _use_kernel(linear.backend, x) or torch_glue_forced():
        return None
    from moemesh.common.kernels.fp8_dequant import use_dequant_linear
    from moemesh.common.kernels.fp8_linear import RowNorm, fp8_linear, row_norm_fits
    from moemesh.common.kernels.fp8_linear_config import DECODE_MAX_TOKENS
    from moemesh.common.kernels.norm_rope import NormKind

    num_tokens = x.shape[0]
    if not 0 < num_tokens <= DECODE_MAX_TOKENS or use_dequant_linear(num_tokens):
        return None
    if not row_norm_fits(num_tokens, linear.out_features, linear.in_features, group, x.device):
        return None
    kind = NormKind.NONE if not norm else NormKind.WEIGHTED if weight is not None else NormKind.UNWEIGHTED
    return fp8_linear(x, linear.weight, linear.scale, row_norm=RowNorm(group, kind, eps, weight, cos, sin))
