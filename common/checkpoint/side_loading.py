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

from moemesh.common.checkpoint.module_loader import fill_from_checkpoint
from moemesh.common.model.quantized import KernelBackend


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
    from moemesh.common.model.attention_side import AttentionSide

    device = torch.device(device)
    config = reader.config
    side = AttentionSide(config, numerics, device="meta")
    shared = {"head.weight": "embed.weight"} if config.tie_word_embeddings else None
    with torch.no_grad():
        fill_from_checkpoint(side, reader, device, shared=shared, backend=backend)
    side.move_rope_tables(device)
    return side.eval()


def drafter_stored_bytes(reader) -> int:
    """The `mtp.*` tensors plus the embedding and head the drafter holds its own copy of."""
    config = reader.config
    own = sum(reader.logical_stored_nbytes(name) for name, spec in reader.inventory.items() if spec.is_mtp)
    head = "embed.weight" if config.tie_word_embeddings else "head.weight"
    return own + reader.logical_stored_nbytes("embed.weight") + reader.logical_stored_nbytes(head)


def _stage_experts(reader, numerics, device, backend: KernelBackend):
    """The stages' routed experts keyed by stage index: FP4/FP8 stacks as stored, dense for float checkpoints."""
    from moemesh.common.checkpoint.expert_stacks import (
        ExpertDtype, ResidentFormat, build_layer_stack, expert_weight_name, read_dense_experts, resident_format,
    )
    from moemesh.common.model.moe import RoutedExperts
    from moemesh.common.model.quantized_experts import ExpertFormat, QuantizedRoutedExperts

    config = reader.config
    stages = range(config.num_nextn_predict_layers)
    experts = list(range(config.n_routed_experts))
    fmt = resident_format(reader.stored_kind(expert_weight_name(0, 0, "w1", "mtp.")), ExpertDtype.NATIVE)
    if fmt is ResidentFormat.DENSE:
        names = {(j, e): tuple(expert_weight_name(j, e, w, "mtp.") for w in ("w1", "w2", "w3"))
                 for j in stages for e in experts}
        weights = {pair: tuple(reader.load(name, numerics.torch_dtype()).to(device) for name in triple)
                   for pair, triple in names.items()}
        return RoutedExperts.from_config(weights, config, numerics)
    stacks = {j: (experts, build_layer_stack(reader, config, j, experts, fmt, device, prefix="mtp."))
              for j in stages}
    expert_format = ExpertFormat.FP4 if fmt is ResidentFormat.FP4 else ExpertFormat.FP8
    return QuantizedRoutedExperts(stacks, config.n_routed_experts, config.swiglu_limit, expert_format=expert_format,
                                  route_weight_before_w2=numerics.route_weight_before_w2, backend=backend)


def load_drafter(reader, numerics, device, backend: KernelBackend = KernelBackend.AUTO):
    """A `DSparkDrafter` with its own copy of the target's embedding and head; raises CheckpointError
    when an `mtp.*` tensor is missing."""
    from moemesh.common.checkpoint.errors import CheckpointError
    from moemesh.common.model.dspark import DSparkDrafter
    from moemesh.common.model.linear import Embedding, Linear
    from moemesh.common.model.rope import RotaryTable

    device = torch.device(device)
    config = reader.config
    missing = [entry.name for spec in reader.inventory.values() if spec.is_mtp
               for entry in spec.stored_entries() if reader.found_dtype(entry.name) is None]
    if missing:
        raise CheckpointError(f"{missing[0]}: missing from {reader.path} ({len(missing)} mtp.* entries missing)")
    dtype = numerics.torch_dtype()
    head_name = "embed.weight" if config.tie_word_embeddings else "head.weight"
    with torch.no_grad():
        embed = fill_from_checkpoint(Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device="meta"),
                                     reader, device, shared={"weight": "embed.weight"}, backend=backend)
        head = fill_from_checkpoint(Linear(config.hidden_size, config.vocab_size, dtype=dtype, device="meta"),
                                    reader, device, shared={"weight": head_name}, backend=backend)
        drafter = DSparkDrafter(config, embed, head, numerics, device="meta")
        fill_from_checkpoint(drafter, reader, device, backend=backend)
        for block in drafter.mtp:  # RoPE tables on the device: no host copy inside a forward
            rope = block.attn.rope
            block.attn.rope = RotaryTable(rope.name, rope.rope_dim, rope.inv_freq.to(device))
        drafter.set_experts(_stage_experts(reader, numerics, device, backend))
    return drafter.eval()


def drafter_resident_bytes(drafter) -> int:
    """Bytes of the drafter's stages, its routed experts and its embedding and head."""
    from moemesh.common.checkpoint.module_loader import module_weight_bytes

    total = module_weight_bytes(drafter) + module_weight_bytes(drafter.embed) + module_weight_bytes(drafter.head)
    experts = drafter.experts_fn
    layers = getattr(experts, "_layers", None)
    if layers is not None:
        total += sum(t.numel() * t.element_size() for held in layers.values()
                     for t in (held.w1, held.s1, held.w2, held.s2, held.w3, held.s3))
    else:
        total += sum(w.numel() * w.element_size() for ws in experts._weights.values() for w in ws)
    return total
