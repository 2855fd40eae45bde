"""What an expert worker holds: its (layer, expert) pairs, in one resident format, with their byte counts.

Quantized formats (FP4, FP8) live in a `QuantizedRoutedExperts` (per-layer stacks, see
`common.checkpoint.expert_stacks`); dense matrices (float checkpoints, `--expert-dtype bf16`) in a
{pair: (w1, w2, w3)} dict. Loading or dropping pairs rebuilds only the layers they touch: the new stack
is allocated once, kept experts are copied from the old stack, new ones read from the checkpoint, then
the old stack is released (the transient peak is one layer's stack, which the startup budget counts).

`resident_bytes` is what the held tensors occupy on the device; `stored_bytes` what the same experts take
in the checkpoint (weights and scales as stored), the figure the 1.05x memory goal is measured against.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moemesh.common.checkpoint.expert_stacks import (
    DenseWeights, ExpertDtype, ResidentFormat, build_layer_stack, expert_stored_nbytes, held_slot_source, plan_layers,
    read_dense_experts, resident_format, stored_expert_kind,
)
from moemesh.common.model.quantized_experts import ExpertFormat, QuantizedRoutedExperts

Pair = tuple[int, int]


class ExpertHoldings:
    def __init__(self, device: torch.device, expert_dtype: ExpertDtype, route_weight_before_w2: bool) -> None:
        self.device = device
        self.expert_dtype = expert_dtype
        self.route_weight_before_w2 = route_weight_before_w2
        self.format: ResidentFormat | None = None  # fixed by the first load
        self.experts: QuantizedRoutedExperts | None = None  # quantized formats
        self.dense: dict[Pair, DenseWeights] = {}  # ResidentFormat.DENSE
        self._stored_bytes: dict[Pair, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def pairs(self) -> list[Pair]:
        return sorted(self._stored_bytes)

    def __contains__(self, pair: Pair) -> bool:
        return pair in self._stored_bytes

    def __len__(self) -> int:
        return len(self._stored_bytes)

    def resident_bytes(self) -> int:
        if self.experts is not None:
            return sum(t.numel() * t.element_size() for held in self.experts._layers.values()
                       for t in (held.w1, held.s1, held.w2, held.s2, held.w3, held.s3))
        return sum(w.numel() * w.element_size() for weights in self.dense.values() for w in weights)

    def stored_bytes(self) -> int:
        return sum(self._stored_bytes.values())

    # ------------------------------------------------------------------ changes
    def adopt(self, experts: QuantizedRoutedExperts) -> None:
        """Hold an in-memory stacked holder built by the caller (kernel tests and benchmarks); its stored
        bytes are taken as its resident bytes."""
        self.experts = experts
        self.format = ResidentFormat.FP4 if next(iter(experts._layers.values())).fmt is ExpertFormat.FP4 \
            else ResidentFormat.FP8
        self._stored_bytes = {(layer, e): experts.bytes_per_expert(layer) for layer, e in experts.pairs}

    def resolve_format(self, reader) -> ResidentFormat:
        if self.format is None:
            self.format = resident_format(stored_expert_kind(reader), self.expert_dtype)
        return self.format

    def load(self, reader, pairs: Iterable[Pair]) -> list[Pair]:
        """Add `pairs` read from `reader`; returns the pairs that were new."""
        new = sorted({(int(l), int(e)) for l, e in pairs} - set(self._stored_bytes))
        if not new:
            return []
        fmt = self.resolve_format(reader)
        config = reader.config
        if fmt is ResidentFormat.DENSE:
            dtype = torch.bfloat16 if self.expert_dtype is ExpertDtype.BF16 else None
            self.dense.update(read_dense_experts(reader, new, dtype, self.device))
        else:
            wanted = set(self._stored_bytes) | set(new)
            touched = {layer for layer, _ in new}
            self._restack(config, [p for p in plan_layers(wanted) if p.layer in touched], reader)
        for layer, expert in new:
            self._stored_bytes[(layer, expert)] = expert_stored_nbytes(reader, layer, expert)
        return new

    def drop(self, pairs: Iterable[Pair], config) -> None:
        gone = {(int(l), int(e)) for l, e in pairs} & set(self._stored_bytes)
        if not gone:
            return
        for pair in gone:
            self._stored_bytes.pop(pair)
            self.dense.pop(pair, None)
        if self.experts is not None:
            touched = {layer for layer, _ in gone}
            self._restack(config, [p for p in plan_layers(self._stored_bytes) if p.layer in touched], None,
                          emptied=touched)

    def _restack(self, config, plans, reader, emptied: set[int] = frozenset()) -> None:
        """Rebuild the planned layers' stacks (kept experts copied from the old stacks, new ones read)."""
        old_layers = dict(self.experts._layers) if self.experts is not None else {}
        source = held_slot_source(old_layers)
        layers = {layer: (held.expert_ids, (held.w1, held.s1, held.w2, held.s2, held.w3, held.s3))
                  for layer, held in old_layers.items() if layer not in emptied}
        for plan in plans:
            layers[plan.layer] = (list(plan.expert_ids),
                                  build_layer_stack(reader, config, plan.layer, plan.expert_ids, self.format,
                                                    self.device, held=source))
            old_layers.pop(plan.layer, None)  # the old stack goes as soon as its copy is done
        fmt = ExpertFormat.FP4 if self.format is ResidentFormat.FP4 else ExpertFormat.FP8
        self.experts = QuantizedRoutedExperts(layers, config.n_routed_experts, config.swiglu_limit, expert_format=fmt,
                                              route_weight_before_w2=self.route_weight_before_w2) if layers else None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
