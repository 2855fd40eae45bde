"""Routed experts kept quantized on the device: each layer's experts stacked (FP4 e2m1 packed + ue8m0 1x32
scales, or FP8), as the grouped kernel reads them.

`QuantizedRoutedExperts` has the exact interface of `RoutedExperts`. On CUDA with bf16/fp16 activations the
grouped Triton kernels (`common.kernels.fp4_experts`) convert weights in registers, ~0.53 byte (FP4 + scales)
per parameter in device memory; on the CPU, FP4 stacks go through the native kernel of `cpu_experts` (the whole
layer in one call) when it is built; elsewhere each expert is dequantised to the activation dtype and multiplied
with torch, one expert at a time (a small CPU expert keeps its dequantised matrices, `_LayerExperts.matrices`).

The CUDA path never synchronises with the host (no `.item()`, `unique`, `nonzero`, `bincount`), so a decode
step that uses it can be captured in a CUDA graph.
Legend: T tokens, K top-k, E experts (held, stacked), R = T·K routed rows, D hidden, I expert width.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.common.kernels.moe_layout import ExpertLayout, sum_slots_in_order
from moemesh.common.kernels.reference import dequant_fp4, dequant_fp8_blockwise
from moemesh.common.model.linear import KeptWideWeight
from moemesh.common.model.moe import ExpertNotHeld, RouteLayoutHandoff, _swiglu
from moemesh.common.model.quantized import KernelBackend, _use_kernel


class ExpertFormat(enum.Enum):
    FP4 = "fp4"  # w [E, N, K/2] packed e2m1 (low nibble = even column), s [E, N, K/32] ue8m0
    FP8 = "fp8"  # w [E, N, K] e4m3, s [E, ceil(N/128), ceil(K/128)] ue8m0


def _dequant_stacked(w: torch.Tensor, s: torch.Tensor, fmt: ExpertFormat) -> torch.Tensor:
    """One expert's (or a stack's) weight -> fp32."""
    if fmt is ExpertFormat.FP4:
        return dequant_fp4(w, s)
    if w.dim() == 2:
        return dequant_fp8_blockwise(w, s)
    return torch.stack([dequant_fp8_blockwise(w[e], s[e]) for e in range(w.shape[0])])


class _LayerExperts:
    """One layer's held experts: stacked weights and the global-id -> stack-index map."""

    def __init__(self, expert_ids: Sequence[int], tensors: Sequence[torch.Tensor], fmt: ExpertFormat,
                 num_routed_experts: int) -> None:
        self.expert_ids = sorted(int(e) for e in expert_ids)
        if list(expert_ids) != self.expert_ids or len(set(self.expert_ids)) != len(self.expert_ids):
            raise ValueError("expert ids of a layer must be given ascending and distinct")
        self.fmt = fmt
        self.w1, self.s1, self.w2, self.s2, self.w3, self.s3 = (t.contiguous() for t in tensors)
        device = self.w1.device
        self.holds_all = len(self.expert_ids) == num_routed_experts
        # local[e] = stack index of global expert e; held[e] = whether it is here
        self.local = torch.zeros(num_routed_experts, dtype=torch.int64, device=device)
        self.held = torch.zeros(num_routed_experts, dtype=torch.bool, device=device)
        ids = torch.tensor(self.expert_ids, dtype=torch.int64, device=device)
        self.local[ids] = torch.arange(len(self.expert_ids), device=device)
        self.held[ids] = True
        self.kept: dict[int, KeptWideWeight] = {}  # stack index -> its dequantised matrices (small, on the CPU)

    def matrices(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert `index`'s (w1, w2, w3) in x's dtype, exact: kept after the first call on the CPU when small
        (linear.KeptWideWeight: a drafter's or the default model's experts), else dequantised now."""
        pairs = ((self.w1, self.s1), (self.w2, self.s2), (self.w3, self.s3))

        def build(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return tuple(_dequant_stacked(w[index], s[index], self.fmt).to(dtype) for w, s in pairs)

        values_per_element = 2 if self.fmt is ExpertFormat.FP4 else 1  # two e2m1 codes a byte
        numel = sum(w[index].numel() for w, _ in pairs) * values_per_element
        sources = tuple(t for pair in pairs for t in pair)  # the whole stacks: any write rebuilds
        kept = self.kept.setdefault(index, KeptWideWeight()).get(x, sources, numel, build)
        return kept if kept is not None else build(x.dtype)

    def kernel_weights(self):
        from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat

        fmt = WeightFormat.FP4_E2M1 if self.fmt is ExpertFormat.FP4 else WeightFormat.FP8_E4M3
        return ExpertWeights(self.w1, self.s1, self.w3, self.s3, self.w2, self.s2, fmt)

    def num_bytes_per_expert(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.w1, self.s1, self.w2, self.s2, self.w3, self.s3))


def layout_by_expert(local_ids: torch.Tensor, num_experts: int) -> ExpertLayout:
    """Stable sort of [T, K] stack indices by expert, without a host sync (offsets by searchsorted,
    where `moe_layout.sort_by_expert`'s bincount may read the maximum back on CUDA)."""
    top_k = local_ids.shape[1]
    flat = local_ids.reshape(-1)  # [R]
    sorted_ids, row_slot_ids = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds).to(torch.int32)  # [E+1], rows < e before e
    return ExpertLayout(row_token_ids=row_slot_ids // top_k, row_slot_ids=row_slot_ids, expert_offsets=offsets)


def _unsort_rows(y: torch.Tensor, row_slot_ids: torch.Tensor) -> torch.Tensor:
    """y [R, D] in expert order -> [R, D] in slot-flat order (row i of y is slot row_slot_ids[i]).

    A gather through the inverse permutation: the scatter `rows[row_slot_ids] = y` it replaces ran as
    torch's index_put at ~0.9 ms per 8K-token layer (docs/performance.md), a gather at ~0.1."""
    inverse = torch.empty_like(row_slot_ids)
    inverse[row_slot_ids] = torch.arange(row_slot_ids.numel(), device=row_slot_ids.device, dtype=row_slot_ids.dtype)
    return y.index_select(0, inverse)


class QuantizedRoutedExperts:
    """`RoutedExperts` with weights kept quantized, stacked per layer.

    layers: {layer: (expert_ids ascending, (w1, s1, w2, s2, w3, s3))}, tensors stacked over those
    experts in that order (hub layouts: w1/w3 [E, I, ...], w2 [E, D, ...]). Slot results are
    summed in slot order (`sum_slots_in_order`), as `RoutedExperts` does, so results do not depend
    on which holder computes which expert.
    """

    def __init__(self, layers: Mapping[int, tuple[Sequence[int], Sequence[torch.Tensor]]], num_routed_experts: int,
                 swiglu_limit: float | None, *, expert_format: ExpertFormat = ExpertFormat.FP4,
                 route_weight_before_w2: bool = False, backend: KernelBackend = KernelBackend.AUTO) -> None:
        self.num_routed_experts = num_routed_experts
        self.swiglu_limit = swiglu_limit
        self.route_weight_before_w2 = route_weight_before_w2
        self.backend = backend
        self._layers = {int(layer): _LayerExperts(ids, tensors, expert_format, num_routed_experts)
                        for layer, (ids, tensors) in layers.items()}
        self._layout_handoffs: dict[int, RouteLayoutHandoff] = {}

    def connect_gates(self, gates: Mapping[int, nn.Module]) -> None:
        """Let the gate of every layer whose experts are all here build this holder's route layout in its launch
        (`moe.RouteLayoutHandoff`); gates: {layer: Gate} of the model whose layers feed this holder in-process."""
        for layer, gate in gates.items():
            held = self._layers.get(layer)
            if held is None or not held.holds_all:
                gate.layout_handoff = None
                self._layout_handoffs.pop(layer, None)
                continue
            handoff = RouteLayoutHandoff(len(held.expert_ids), held.local)
            gate.layout_handoff = handoff
            self._layout_handoffs[layer] = handoff

    @classmethod
    def from_config(cls, layers, config, numerics=None, **kwargs) -> "QuantizedRoutedExperts":
        from moemesh.common.model.config import NumericsConfig

        numerics = numerics or NumericsConfig()
        fmt = ExpertFormat.FP8 if config.expert_dtype == "fp8" else ExpertFormat.FP4
        return cls(layers, config.n_routed_experts, config.swiglu_limit, expert_format=fmt,
                   route_weight_before_w2=numerics.route_weight_before_w2, **kwargs)

    @classmethod
    def from_expert_tensors(cls, experts: Mapping[tuple[int, int], Sequence[torch.Tensor]], num_routed_experts: int,
                            swiglu_limit: float | None, **kwargs) -> "QuantizedRoutedExperts":
        """{(layer, expert): (w1, s1, w2, s2, w3, s3)} per-expert checkpoint tensors -> stacked holder."""
        by_layer: dict[int, list[int]] = {}
        for layer, expert in sorted(experts):
            by_layer.setdefault(layer, []).append(expert)
        layers = {}
        for layer, ids in by_layer.items():
            parts = [torch.stack([experts[(layer, e)][i] for e in ids]) for i in range(6)]
            layers[layer] = (ids, parts)
        return cls(layers, num_routed_experts, swiglu_limit, **kwargs)

    # ----------------------------------------------------------------------- RoutedExperts interface
    @property
    def pairs(self) -> list[tuple[int, int]]:
        return sorted((layer, e) for layer, held in self._layers.items() for e in held.expert_ids)

    def holds(self, layer: int, expert: int) -> bool:
        held = self._layers.get(layer)
        return held is not None and expert in held.expert_ids

    def held_mask(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, K] -> bool [T, K]: which slots this holder can compute."""
        held = self._layers.get(layer)
        if held is None:
            return torch.zeros_like(ids, dtype=torch.bool)
        return held.held.to(ids.device)[ids]

    def bytes_per_expert(self, layer: int) -> int:
        return self._layers[layer].num_bytes_per_expert()

    def per_expert_outputs(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           slot_mask: torch.Tensor | None = None, *, check_held: bool = True) -> torch.Tensor:
        """Weighted output of every (token, slot) -> [T, K, D]; zero where slot_mask is False.

        Raises ExpertNotHeld if a selected slot's expert is not here (checked without a host sync
        only when this holder has every expert of the layer and no mask is given). check_held=False:
        the caller's mask selects held experts only; no check, so no host sync on a device."""
        held = self._layers.get(layer)
        if held is None:
            raise ExpertNotHeld(f"layer {layer} has no experts here")
        if check_held and (slot_mask is not None or not held.holds_all):
            selected = torch.ones_like(ids, dtype=torch.bool) if slot_mask is None else slot_mask
            missing = selected & ~held.held[ids]
            if bool(missing.any()):
                raise ExpertNotHeld(f"layer {layer}: experts {sorted(set(ids[missing].tolist()))} are not held here")
        num_tokens, top_k = ids.shape
        if _use_kernel(self.backend, hidden):
            handoff = self._layout_handoffs.get(layer)
            layout = handoff.take(ids, weights) if handoff is not None and slot_mask is None else None
            rows = self._slot_rows_kernel(held, hidden, ids, weights, slot_mask, stack_table=held.local,
                                          layout=layout)  # [R, D]
            return rows.view(num_tokens, top_k, -1)  # masked slots already zero
        if hidden.device.type == "cpu" and held.fmt is ExpertFormat.FP4:
            from moemesh.common.model.cpu_experts import default_runner, expert_rows

            runner = default_runner()
            if runner.native is not None:  # one native call for the layer (masked slots stay zero)
                return expert_rows(held, hidden, ids.long(), weights, slot_mask, self.swiglu_limit,
                                   self.route_weight_before_w2, runner=runner)
        local = held.local[ids]  # [T, K]
        rows = self._rows_torch(held, hidden, local, weights, slot_mask)
        out = rows.view(num_tokens, top_k, -1)
        if slot_mask is not None:
            out = out * slot_mask[..., None].to(out.dtype)
        return out

    def __call__(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D], ids/weights [T, K] -> routed sum [T, D]. Raises ExpertNotHeld.

        On the kernel path at decode sizes: the three launches of `_slot_rows_kernel`, then the slot
        sum (one launch on CUDA). The model's layer loops take `per_expert_outputs` instead
        (`moe.routed_answer`) and leave the sum to hc_post's launch."""
        return sum_slots_in_order(self.per_expert_outputs(layer, hidden, ids, weights))

    # ----------------------------------------------------------------------- backends
    def _rows_kernel(self, held: _LayerExperts, hidden: torch.Tensor, local: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        """Grouped Triton kernels on stack indices local [T, K] -> [T·K, D] rows indexed by flat slot t·K + k."""
        return self._slot_rows_kernel(held, hidden, local, weights, None, stack_table=None)

    def _slot_rows_kernel(self, held: _LayerExperts, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                          slot_mask: torch.Tensor | None, *, stack_table: torch.Tensor | None,
                          layout=None) -> torch.Tensor:
        """hidden [T, D], ids / weights [T, K] (ids read through stack_table when given, else stack indices),
        slot_mask [T, K] or None -> [T·K, D] rows indexed by flat slot t·K + k, exact zeros where masked.
        layout: the route layout of these ids and weights when the gate's launch already built it.

        Three launches, no host sync: the route layout (`route_layout.route_layout`: stable sort of the
        selected slots by expert, masked slots after every expert's rows), `grouped_gate_up` reading x
        through the rows' token ids, `grouped_down` writing each row to its slot and zeros to the
        masked slots. Masked slots are not computed. Long FP4 prefill takes `_rows_dequant`."""
        from moemesh.common.kernels.fp4_experts import grouped_down, grouped_gate_up, quartered_handoff
        from moemesh.common.kernels.route_layout import route_layout

        if self._uses_dequant_path(held, hidden, ids.numel()):
            local = stack_table[ids] if stack_table is not None else ids  # [T, K]
            rows = self._rows_dequant(held, hidden, local, weights)  # [T·K, D]
            if slot_mask is None:
                return rows
            return (rows.view(*ids.shape, -1) * slot_mask[..., None].to(rows.dtype)).view(rows.shape)
        if layout is None:
            layout = route_layout(ids, weights, len(held.expert_ids), stack_table=stack_table, slot_mask=slot_mask)
        stacked = held.kernel_weights()
        quartered = quartered_handoff(ids.numel(), stacked, hidden.dtype, hidden.device)
        h = grouped_gate_up(hidden, layout.expert_offsets, stacked, swiglu_limit=self.swiglu_limit,
                            x_row_ids=layout.row_token_ids, quartered_out=quartered)  # [R, I] in expert order
        if self.route_weight_before_w2:  # a per-row scale: the same in either column order
            h = (h.float() * layout.row_weights[:, None]).to(hidden.dtype)
            return grouped_down(h, layout.expert_offsets, stacked, out_row_ids=layout.row_slot_ids,
                                hidden_quartered=quartered)
        return grouped_down(h, layout.expert_offsets, stacked, row_weights=layout.row_weights,
                            out_row_ids=layout.row_slot_ids, hidden_quartered=quartered)  # [R, D] in slot order

    def _uses_dequant_path(self, held: _LayerExperts, hidden: torch.Tensor, num_rows: int) -> bool:
        """Long FP4 prefill: each expert dequantised once, grouped bf16 GEMMs (one host sync; never in decode)."""
        from moemesh.common.kernels.fp4_prefill import use_dequant_path

        return (held.fmt is ExpertFormat.FP4 and hidden.dtype == torch.bfloat16 and not self.route_weight_before_w2
                and hidden.is_cuda and use_dequant_path(num_rows, len(held.expert_ids)))

    def _rows_dequant(self, held: _LayerExperts, hidden: torch.Tensor, local: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """The long-prefill path on stack indices local [T, K] -> [T·K, D] rows indexed by flat slot."""
        from moemesh.common.kernels.fp4_prefill import grouped_experts_dequant

        layout = layout_by_expert(local, len(held.expert_ids))
        x_sorted = hidden[layout.row_token_ids]  # [R, D]
        row_weights = weights.reshape(-1)[layout.row_slot_ids].float()  # [R]
        y = grouped_experts_dequant(x_sorted, layout.expert_offsets, held.kernel_weights(),
                                    swiglu_limit=self.swiglu_limit, row_weights=row_weights)
        return _unsort_rows(y, layout.row_slot_ids)

    def _rows_torch(self, held: _LayerExperts, hidden: torch.Tensor, local: torch.Tensor, weights: torch.Tensor,
                    slot_mask: torch.Tensor | None) -> torch.Tensor:
        """Per expert: its three matrices in the activation dtype (`_LayerExperts.matrices`), then `RoutedExperts`'
        math."""
        top_k = local.shape[1]
        rows = hidden.new_zeros(local.numel(), hidden.shape[1])
        flat_local = local.reshape(-1)
        usable = torch.ones_like(flat_local, dtype=torch.bool) if slot_mask is None else slot_mask.reshape(-1)
        for index in torch.unique(flat_local[usable]).tolist():  # ascending stack index = ascending id
            (slots,) = torch.where((flat_local == index) & usable)
            x = hidden[slots // top_k]
            w1, w2, w3 = held.matrices(index, hidden)
            route = weights.reshape(-1)[slots][:, None]
            act = _swiglu(F.linear(x, w1), F.linear(x, w3), self.swiglu_limit)
            if self.route_weight_before_w2:
                rows[slots] = F.linear(act * route.to(act.dtype), w2)
            else:
                rows[slots] = F.linear(act, w2) * route.to(act.dtype)
        return rows


def dequantized_expert_weights(experts: QuantizedRoutedExperts, pairs: Iterable[tuple[int, int]] | None = None
                               ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{(layer, expert): (w1, w2, w3)} fp32, the `RoutedExperts` weights equal to a quantized holder."""
    out = {}
    for layer, expert in (pairs if pairs is not None else experts.pairs):
        held = experts._layers[layer]
        index = held.expert_ids.index(expert)
        out[(layer, expert)] = tuple(_dequant_stacked(w[index], s[index], held.fmt)
                                     for w, s in ((held.w1, held.s1), (held.w2, held.s2), (held.w3, held.s3)))
    return out
