"""Quantisation-aware training: the forward and backward run on the weights as the checkpoint will
store them, the optimizer updates float master weights.

Every trainable weight that the hub format stores in fewer bits than fp32 (FP8 e4m3 with 128×128
ue8m0 blocks for dense linears, FP4 e2m1 with per-32 ue8m0 scales for routed experts, bf16 for the
embedding, head, norms, compressors and gates; `common.model.inventory`) gets a `QuantShadow` entry. `quantized()` is a context around one step's forward + backward: on entry each
such weight is replaced in place by `dequantize(quantize(w))` (the writer's own quantisers, so the
values are exactly what `export_checkpoint` writes), the float values kept aside; on exit they are put
back, with the gradient (computed at the quantised point) left in `.grad` for the optimizer: the
straight-through estimator, without touching the model's modules or their parameter names. fp32
tensors (HC, sinks, ape, router bias) are stored as trained.

Why: the exported checkpoint is the only copy of the weights that travels between training runs
(optimizer state and float masters do not), so a run resumed from it starts from exactly the
quantised weights, and a model trained this way loses nothing more at export than it saw in training.
Legend: E experts, I expert width, D hidden.
"""

from __future__ import annotations

import contextlib

import torch

from moemesh.common.checkpoint.quant import (dequantize_fp4, dequantize_fp8_block, quantize_fp4,
                                             quantize_fp8_block)
from moemesh.common.model.config import ModelConfig
from moemesh.common.model.inventory import StorageKind, tensor_inventory


def fake_quantize(weight: torch.Tensor, storage: StorageKind, block_size: tuple[int, int] | None) -> torch.Tensor:
    """weight [..., O, I] float -> the same shape, dequantised from its FP8 / FP4 / BF16 storage (fp32).
    Stacked experts [E, O, I] are quantised as one [E·O, I] matrix: FP4 blocks run along a row, FP8
    blocks are whole 128-row tiles when O is a multiple of 128 (checked), so no block spans two
    experts and the result equals quantising expert by expert."""
    matrix = weight.detach().float().reshape(-1, weight.shape[-1])
    if storage is StorageKind.FP8_BLOCK:
        if weight.dim() > 2 and weight.shape[-2] % block_size[0]:
            raise ValueError(f"stacked FP8 weights need rows a multiple of {block_size[0]}, got {tuple(weight.shape)}")
        out = dequantize_fp8_block(*quantize_fp8_block(matrix, block_size), block_size=block_size)
    elif storage is StorageKind.FP4_BLOCK:
        out = dequantize_fp4(*quantize_fp4(matrix, block_size[1]))
    elif storage is StorageKind.BF16:
        out = matrix.to(torch.bfloat16).float()
    else:
        raise ValueError(f"{storage} is not a quantised storage")
    return out.view(weight.shape)


class QuantShadow:
    """The quantised trainable weights of a model: (parameter, storage, block) per hub tensor."""

    def __init__(self, entries: list[tuple[str, torch.nn.Parameter, StorageKind, tuple[int, int]]]) -> None:
        self.entries = entries

    @classmethod
    def for_modules(cls, config: ModelConfig, named_weights: dict[str, torch.nn.Parameter]) -> "QuantShadow":
        """named_weights: hub name -> parameter (a stacked expert parameter under the name of its
        expert 0, `layers.{l}.ffn.experts.0.w1.weight`); those the inventory stores quantised are kept."""
        specs = tensor_inventory(config)
        entries = []
        for name, param in named_weights.items():
            spec = specs.get(name)
            if spec is None:
                raise KeyError(f"{name} is not in the checkpoint inventory")
            if (spec.is_quantized or spec.storage is StorageKind.BF16) and param.requires_grad:
                entries.append((name, param, spec.storage, spec.block_size))
        return cls(entries)

    @property
    def num_params(self) -> int:
        return sum(param.numel() for _, param, _, _ in self.entries)

    @torch.no_grad()
    def project(self) -> None:
        """Replace every weight by its quantised value for good (after loading, or before export)."""
        for _, param, storage, block in self.entries:
            param.copy_(fake_quantize(param, storage, block))

    @contextlib.contextmanager
    def quantized(self):
        """Forward + backward inside run on the quantised weights; the float masters come back on exit."""
        masters = []
        with torch.no_grad():
            for _, param, storage, block in self.entries:
                masters.append(param.detach().clone())
                param.copy_(fake_quantize(param, storage, block))
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, param, _, _), master in zip(self.entries, masters):
                    param.copy_(master)


def stacked_expert_names(prefix_of_layer, experts) -> dict[str, torch.nn.Parameter]:
    """Hub names for `StackedExperts` parameters: the whole [E, ...] stack under expert 0's name
    (every expert of a layer has the same storage)."""
    out = {}
    for layer in range(len(experts.w1)):
        for kind in ("w1", "w2", "w3"):
            out[f"{prefix_of_layer(layer)}ffn.experts.0.{kind}.weight"] = getattr(experts, kind)[layer]
    return out
