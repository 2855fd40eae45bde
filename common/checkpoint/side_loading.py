"""The attention side and the drafter read from a checkpoint, quantized tensors kept quantized.

`load_attention_side` builds an `AttentionSide` on the meta device and fills it with
`module_loader.fill_from_checkpoint` (FP8 linears as `Fp8Linear`, the rest cast one tensor at a
time). `load_drafter_modules` does the same for the DSpark / MTP stages, with the stages' routed
experts stacked per stage in their stored format (`expert_stacks`) and the target's embedding and
head as the drafter's own copy. `WeightBytes` pairs what a worker's weights occupy on its device
with what the same tensors take in the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.checkpoint.module_loader import fill_from_checkpoint
from common.model.quantized import KernelBackend


@dataclass(frozen=True)
class WeightBytes:
    resident: int  # bytes the held weights occupy on the worker's device
    stored: int  # bytes the same tensors take in the checkpoint (weights and scales as stored)

    @property
    def ratio(self) -> float:
        return self.resident / self.stored if self.stored else 0.0


def attention_stored_bytes(reader) -> int:
    return sum(reader.logical_stored_nbytes(name) for name, spec in reader.inventory.items()
               if spec.is_attention_side)


def load_attention_side(reader, numerics, device, backend: KernelBackend = KernelBackend.AUTO):
    from common.model.attention_side import AttentionSide
    from common.model.random_init import move_rope_tables

    device = torch.device(device)
    config = reader.config
    side = AttentionSide(config, numerics, device="meta")
    shared = {"head.weight": "embed.weight"} if config.tie_word_embeddings else None
    with torch.no_grad():
        fill_from_checkpoint(side, reader, device, shared=shared, backend=backend)
    move_rope_tables(side, device)
    return side.eval()
