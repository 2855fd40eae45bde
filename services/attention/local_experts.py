"""Routed experts held by the attention worker itself: the part of the placement on its own device.

A placement may name the attention worker as a holder (`[[attention]] placement`, like an expert
worker's). Those pairs are loaded with the expert worker's holder (`common.checkpoint.expert_holdings`)
and computed in-process by `MoEDispatcher`: no Dispatch, no Combine, no copy. `slot_outputs` is the
expert worker's per-slot math on the same held stacks, so a slot gives the same value whichever
holder computes it:
- CPU, FP4 stacks: `common.model.cpu_experts.expert_rows` (native kernel or torch blocks);
- other quantized stacks on the grouped Triton kernels (CUDA): with a mask and its slot count known on
  the host (the dispatcher's split counted them), only the selected rows, in ascending slot order, as an
  expert worker runs them (same rows per expert, so the same kernel configuration); without, every
  slot's row (`QuantizedRoutedExperts.per_expert_outputs`), the mask applied after. No host sync
  outside long FP4 prefill;
- dense stacks (float checkpoints, `bf16`): `RoutedExperts.per_expert_outputs`.
Legend: T tokens, K top-k slots, D hidden.
"""

from __future__ import annotations

import torch

from moemesh.common.checkpoint.expert_holdings import ExpertHoldings
from moemesh.common.checkpoint.expert_stacks import ExpertDtype, ResidentFormat
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.quantized import KernelBackend, _use_kernel


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

    def connect_gates(self, gates) -> None:
        """Layers whose experts are all here take their route layout from the gate's launch
        (`QuantizedRoutedExperts.connect_gates`); gates: {layer: Gate}."""
        if self.holdings.experts is not None:
            self.holdings.experts.connect_gates(gates)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return self.holdings.pairs

    def capturable(self, device: torch.device) -> bool:
        """Whether `slot_outputs` over every slot (no mask) runs on `device` without a host sync, so a CUDA
        graph can capture it: quantized stacks on the grouped kernels (16-bit activations on CUDA)."""
        experts = self.holdings.experts
        if device.type != "cuda" or experts is None:
            return False
        return experts.backend is KernelBackend.KERNEL or (
            experts.backend is KernelBackend.AUTO and self.dtype in (torch.bfloat16, torch.float16))

    def slot_outputs(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     slot_mask: torch.Tensor | None, num_selected: int | None = None) -> torch.Tensor:
        """hidden [T, D], ids / weights [T, K], slot_mask [T, K] bool (None: every slot; selected slots
        must name held experts; num_selected: how many, when known) -> weighted output of every selected
        slot [T, K, D], zeros elsewhere."""
        experts = self.holdings.experts
        if experts is None:
            return self._dense.per_expert_outputs(layer, hidden, ids, weights, slot_mask)
        held = experts._layers[layer]
        if hidden.device.type == "cpu" and self.holdings.format is ResidentFormat.FP4:
            from moemesh.common.model.cpu_experts import expert_rows

            return expert_rows(held, hidden, ids.long(), weights, slot_mask, experts.swiglu_limit,
                               experts.route_weight_before_w2)
        if slot_mask is not None and num_selected is not None and _use_kernel(experts.backend, hidden):
            return _selected_rows(experts, held, hidden, ids, weights, slot_mask, num_selected)
        return experts.per_expert_outputs(layer, hidden, ids, weights, slot_mask, check_held=False)


def _selected_rows(experts, held, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   slot_mask: torch.Tensor, num_selected: int) -> torch.Tensor:
    """The grouped kernels on the R = num_selected selected slots only (ascending flat slot t·K + k, as
    the expert worker's selection) -> [T, K, D], zeros elsewhere. No host sync: R is given."""
    num_tokens, top_k = ids.shape
    flat = torch.nonzero_static(slot_mask.reshape(-1), size=num_selected).squeeze(1)  # [R]
    stack_index = held.local[ids.reshape(-1)[flat]]  # [R]
    rows = experts._rows_kernel(held, hidden.index_select(0, flat // top_k), stack_index[:, None],
                                weights.reshape(-1)[flat][:, None])  # [R, D]
    out = hidden.new_zeros(num_tokens * top_k, hidden.shape[1])  # [T·K, D]
    out[flat] = rows.to(out.dtype)
    return out.view(num_tokens, top_k, -1)
