"""The dense building blocks every projection and norm goes through.

Every dense projection of the model is a `Linear` (or `GroupedLinear`) so that a later quantized
implementation (FP8 weights kept on GPU) can replace this one class without touching the math.
Weights are created uninitialised (`torch.empty`): they always come from a state dict. A `Linear`
or `Embedding` weight may be held in a narrower float dtype than the activations (a bf16 checkpoint
tensor on the float32 CPU path, kept as stored): it is then widened, which is exact. On the CPU a
weight whose widened copy is at most `CPU_WIDE_WEIGHT_MAX_BYTES` keeps that copy (`KeptWideWeight`), so a
step does not widen it again (for a small model the conversion costs more than the product: the default
model's bf16 head, 1.5 ms widened per call against 0.5 ms kept, one core); a larger one (V4-Flash's head)
is widened per call, bounding host memory.
The RMS norms run one Triton launch on CUDA (`common.kernels.norm_rope`, dispatch rules in
`common.kernels.glue`); the torch code here is the CPU path and their reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.common.kernels.glue import use_triton_glue


CPU_WIDE_WEIGHT_MAX_BYTES = 16 << 20


class KeptWideWeight:
    """One CPU weight in the activations' dtype, built from its stored tensors on the first call and kept
    until one of them changes (another tensor, or an in-place write): see the module docstring."""

    def __init__(self) -> None:
        self._entry: tuple[tuple, torch.Tensor] | None = None

    def get(self, x: torch.Tensor, sources: tuple[torch.Tensor, ...], numel: int, build) -> torch.Tensor | None:
        """build(dtype) -> the wide weight of `numel` elements; None when x or a source is not on the CPU or
        the copy would exceed CPU_WIDE_WEIGHT_MAX_BYTES (the caller then builds a transient one)."""
        if x.device.type != "cpu" or any(t.device.type != "cpu" for t in sources):
            return None
        if numel * x.element_size() > CPU_WIDE_WEIGHT_MAX_BYTES:
            return None
        key = tuple((t.data_ptr(), t._version) for t in sources) + (x.dtype,)
        if self._entry is None or self._entry[0] != key:
            self._entry = (key, build(x.dtype))
        return self._entry[1]


def _parameter(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x · Wᵀ, no bias. weight [out_features, in_features] (hub layout)."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _parameter(out_features, in_features, dtype=dtype, device=device)
        self._wide = KeptWideWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return F.linear(x, self._weight_as(x))

    def _weight_as(self, x: torch.Tensor) -> torch.Tensor:
        """The weight in x's dtype: itself, the kept wide copy (CPU), or a transient copy."""
        weight = self.weight
        if weight.dtype == x.dtype:
            return weight
        kept = self._wide.get(x, (weight,), weight.numel(), weight.to)
        return kept if kept is not None else weight.to(x.dtype)


class GroupedLinear(Linear):
    """Block-diagonal projection used by the grouped attention output (`wo_a`).

    weight [G·O, I] is viewed as [G, O, I]: group g of the input [T, G, I] meets only block g.
    """

    def __init__(self, in_features_per_group: int, out_features: int, num_groups: int, *, dtype, device=None):
        super().__init__(in_features_per_group, out_features, dtype=dtype, device=device)
        if out_features % num_groups:
            raise ValueError(f"out_features={out_features} not divisible by num_groups={num_groups}")
        self.num_groups = num_groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # T tokens, G groups, I input per group, O output per group
        num_tokens = x.shape[0]
        weight = self._weight_as(x).view(self.num_groups, -1, self.in_features).transpose(1, 2)  # [G, I, O]
        y = torch.bmm(x.transpose(0, 1), weight)  # [G, T, I] @ [G, I, O] -> [G, T, O]
        return y.transpose(0, 1).reshape(num_tokens, -1)  # [T, G·O]


class RMSNorm(nn.Module):
    """x · rsqrt(mean(x²) + eps) · w, computed in fp32 with an fp32 weight, cast back once."""

    def __init__(self, dim: int, eps: float, *, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter(dim, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` as a function: x [..., C], weight [C] fp32 -> x's dtype."""
    if use_triton_glue(x, weight):
        from moemesh.common.kernels import norm_rope

        return norm_rope.rms_norm(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-vector RMS normalisation without a weight (query heads, mHC input).

    The scale is rounded to x's dtype before the product (bf16 on GPU): the fused kernels keep that.
    """
    if use_triton_glue(x):
        from moemesh.common.kernels import norm_rope

        return norm_rope.unweighted_rms_norm(x, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Embedding(nn.Module):
    """Token embedding table, weight [V, D] (hub `embed.weight`)."""

    def __init__(self, vocab_size: int, dim: int, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.dtype = dtype  # of the rows it returns, whatever the table is held in
        self.weight = _parameter(vocab_size, dim, dtype=dtype, device=device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        return F.embedding(token_ids, self.weight).to(self.dtype)


def parameter(*shape: int, dtype: torch.dtype, device=None) -> nn.Parameter:
    """An uninitialised, non-trainable parameter (filled by `load_state_dict`)."""
    return _parameter(*shape, dtype=dtype, device=device)


def assign_frozen(module: nn.Module, hub_sd: dict[str, torch.Tensor], device: torch.device | str,
                  what: str) -> nn.Module:
    """Fill a module built on the meta device from `hub_sd` (its own names; others are ignored): each
    tensor cast to its parameter's dtype, moved to `device`, frozen. KeyError names the first
    missing tensors of `what`."""
    own = module.state_dict()
    missing = [name for name in own if name not in hub_sd]
    if missing:
        raise KeyError(f"{what} tensors missing from the state dict: {missing[:10]}")
    cast = {name: hub_sd[name].to(device=device, dtype=own[name].dtype) for name in own}
    module.load_state_dict(cast, strict=True, assign=True)
    for param in module.parameters():
        param.requires_grad_(False)
    return module
