"""Routed experts held by the attention worker itself: the part of the placement on its own device.

A placement may name the attention worker as a holder (`[[attention]] placement`, like an expert
worker's). Those pairs are loaded with the expert worker's holder (`common.checkpoint.expert_holdings`)
and computed in-process by `MoEDispatcher`: no Dispatch, no Combine, no copy. `slot_outputs` is the
expert worker's per-slot math on the same held stacks, so a slot gives the same value whichever
holder computes it:
- CPU, FP4 stacks: `common.model.cpu_experts.expert_rows` (native kernel or torch blocks);
- other quantized stacks: `QuantizedRoutedExperts.per_expert_outputs` (grouped Triton kernels on CUDA,
  every slot's row computed, the mask applied after; no host sync outside long FP4 prefill);
- dense stacks (float checkpoints, `bf16`): `RoutedExperts.per_expert_outputs`.
Legend: T tokens, K top-k slots, D hidden.
"""

from __future__ import annotations

import torch

from moemesh.common.checkpoint.expert_holdings import ExpertHoldings
from moemesh.common.checkpoint.expert_stacks import ExpertDtype, ResidentFormat
from moemesh.common.model.moe import RoutedExperts


class LocalExperts:
    def __init__(self, device: torch.device, dtype: torch.dtype, route_weight_before_w2: bool = False) -> None:
        """dtype: the activations' (dense weights are kept in it, as the expert worker casts them per call)."""
        self.holdings = ExpertHoldings(device, ExpertDtype.NATIVE, route_weight_before_w2)
        self.dtype = dtype
        self.swiglu_limit: float | None = None
        self._dense: RoutedExperts | None = None

    def load(self, reader, pairs) -> None:
        """Read `pairs` (layer, expert) from the checkpoint `reader` onto the device."""
        self.holdings.load(reader, pairs)
        self.swiglu_limit = reader.config.swiglu_limit
        if self.holdings.format is ResidentFormat.DENSE:
            weights = {pair: tuple(w.to(self.dtype) for w in matrices) for pair, matrices in self.holdings.dense.items()}
            self._dense = RoutedExperts(weights, self.swiglu_limit,
                                        route_weight_before_w2=self.holdings.route_weight_before_w2)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return self.holdings.pairs

    def slot_outputs(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     slot_mask: torch.Tensor | None) -> torch.Tensor:
        """hidden [T, D], ids / weights [T, K], slot_mask [T, K] bool (None: every slot; selected slots
        must name held experts) -> weighted output of every selected slot [T, K, D], zeros elsewhere."""
        experts = self.holdings.experts
        if experts is None:
            return self._dense.per_expert_outputs(layer, hidden, ids, weights, slot_mask)
        held = experts._layers[layer]
        if hidden.device.type == "cpu" and self.holdings.format is ResidentFormat.FP4:
            from moemesh.common.model.cpu_experts import expert_rows

            return expert_rows(held, hidden, ids.long(), weights, slot_mask, experts.swiglu_limit,
                               experts.route_weight_before_w2)
        return experts.per_expert_outputs(layer, hidden, ids, weights, slot_mask, check_held=False)
