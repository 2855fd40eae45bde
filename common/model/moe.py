"""MoE pieces (docs/model.md §2.8, §2.9): the gate and shared expert (attention side) and the routed experts.

Routed experts are a separate object so that they can live in other processes: the attention side
produces (x, ids, weights) per layer, a `RoutedExperts` holder (or several) turns them into the
routed sum. Slot order is expert-id order (the gate sorts ids ascending per token), and the routed
sum adds the K slot outputs in slot order, so placing experts on several holders gives results bit
for bit equal to one holder: each expert always processes the same rows, and the final sum order
does not depend on placement.
Legend: T tokens, D hidden, K experts per token, E routed experts, I expert width, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.common.kernels.glue import use_triton_glue
from moemesh.common.kernels.moe_layout import sum_slots_in_order
from moemesh.common.model.config import ModelConfig, NumericsConfig, RouterKind
from moemesh.common.model.linear import Linear, parameter

# experts_fn(layer, x [T, D], ids [T, K], weights [T, K]) -> routed output [T, D]
ExpertsFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def routed_answer(experts_fn: ExpertsFn, layer: int, x: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """The routed part in the form `AttentionSide.ffn_post` takes it: a single in-process holder's per-slot
    outputs [T, K, D] (`per_expert_outputs`, every slot; ffn_post's hc_post sums them in slot order in its own
    launch, as the holder's `__call__` would in one more), any other experts function's routed sum [T, D]."""
    per_slot = getattr(experts_fn, "per_expert_outputs", None)
    if per_slot is not None:
        return per_slot(layer, x, ids, weights)  # [T, K, D]
    return experts_fn(layer, x, ids, weights)  # [T, D]


class ExpertNotHeld(KeyError):
    """A token was routed to a (layer, expert) this holder does not have."""


class RouteLayoutHandoff:
    """The route layout a layer's gate computed in its launch (`gate.gate_with_layout`) for the in-process holder
    of every expert of that layer, handed over once for the very ids and weights it was made from (same memory and
    shape): the holder then skips its own layout launch. The gate replaces or clears it on every call, so no
    layout outlives its step."""

    def __init__(self, num_held: int, stack_table: torch.Tensor) -> None:
        self.num_held = num_held
        self.stack_table = stack_table  # [E] int64 global id -> stack index
        self._offered: tuple | None = None

    def offer(self, ids: torch.Tensor, weights: torch.Tensor, layout) -> None:
        self._offered = (ids, weights, layout)

    def clear(self) -> None:
        self._offered = None

    def take(self, ids: torch.Tensor, weights: torch.Tensor):
        """The layout made from these ids and weights (then forgotten), or None."""
        offered, self._offered = self._offered, None
        if offered is None:
            return None
        offered_ids, offered_weights, layout = offered
        same = all(a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                   for a, b in ((offered_ids, ids), (offered_weights, weights)))
        return layout if same else None


class Gate(nn.Module):
    """Affinity s = sqrt(softplus(x · Wᵀ)); learned layers pick top-k of s + bias (bias only for
    selection), hash layers take tid2eid[token]; weights = scale · s[ids] / Σ s[ids].

    Ties in s + bias at the k-th place select the lowest expert ids (torch.topk's choice on CUDA;
    the CPU path gets it from a stable sort). On CUDA one Triton launch computes all of it
    (`common/kernels/gate.py`); the torch code below is the CPU path and the reference, and
    `MOEMESH_TORCH_GLUE=1` forces it on CUDA too (`common/kernels/glue.py`)."""

    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.kind = config.mlp_layer_types[layer]
        self.top_k = config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = parameter(config.n_routed_experts, config.hidden_size, dtype=dtype, device=device)
        if self.kind is RouterKind.HASH:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long, device=device))
        else:
            self.bias = parameter(config.n_routed_experts, dtype=torch.float32, device=device)
        self.layout_handoff: RouteLayoutHandoff | None = None  # set by the in-process holder of all its experts

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], token_ids [T] -> ids [T, K] int64 ascending, weights [T, K] (x's dtype). With a
        `layout_handoff`, at decode sizes on CUDA the same launch also builds the holder's route layout."""
        hashed = self.kind is RouterKind.HASH
        handoff = self.layout_handoff
        if handoff is not None:
            handoff.clear()
        if use_triton_glue(x, self.weight, *([token_ids] if hashed else [])):
            from moemesh.common.kernels import gate as gate_kernel

            if gate_kernel.supports(x, self.weight):
                routing = dict(top_k=self.top_k, route_scale=self.routed_scaling_factor,
                               bias=None if hashed else self.bias, tid2eid=self.tid2eid if hashed else None,
                               token_ids=token_ids if hashed else None)
                if handoff is not None and gate_kernel.fuses_layout(x.shape[0], self.top_k):
                    ids, weights, layout = gate_kernel.gate_with_layout(
                        x, self.weight, num_held=handoff.num_held, stack_table=handoff.stack_table, **routing)
                    handoff.offer(ids, weights, layout)
                    return ids, weights
                return gate_kernel.gate(x, self.weight, **routing)
        scores = F.softplus(F.linear(x, self.weight)).sqrt()  # [T, E]
        if hashed:
            ids = self.tid2eid[token_ids].long()
        else:  # top-k with ties to the lowest id
            ids = torch.sort(scores + self.bias, dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        ids = ids.sort(dim=-1).values
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit:  # gate clamped from above only, up both ways
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class SharedExpert(nn.Module):
    """Always-on SwiGLU expert: w2(silu(w1 x) · w3 x); clamped like routed ones unless the
    reference numerics switch it off.

    When w1 and w3 are FP8 linears (`common.model.quantized.Fp8Linear`, swapped in at load) whose decode kernel
    would run, the gate and up products and the SwiGLU are one launch (`fp8_linear.fp8_gate_up_swiglu`, reading
    both weights where they are) and w2 a second: two launches instead of seven. Same values as the three
    linears and the torch SwiGLU below, which stay the CPU path, the prefill path and the reference
    (`MOEMESH_TORCH_GLUE=1` forces them on CUDA too)."""

    def __init__(self, config: ModelConfig, numerics: NumericsConfig, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        inter = config.moe_intermediate_size
        self.limit = config.swiglu_limit if numerics.shared_expert_clamp else None
        self.w1 = Linear(config.hidden_size, inter, dtype=dtype, device=device)
        self.w2 = Linear(inter, config.hidden_size, dtype=dtype, device=device)
        self.w3 = Linear(config.hidden_size, inter, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        hidden = self._fused_gate_up(x)  # [T, I] or None
        if hidden is None:
            hidden = _swiglu(self.w1(x), self.w3(x), self.limit)
        return self.w2(hidden)

    def _fused_gate_up(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [T, D] -> SwiGLU hidden [T, I] in one launch, or None where the unfused path runs (w1, w3 not both
        FP8 linears on their decode kernel path, or the torch glue forced)."""
        from moemesh.common.kernels.glue import torch_glue_forced
        from moemesh.common.model.quantized import Fp8Linear, _use_kernel

        w1, w3 = self.w1, self.w3
        if not (type(w1) is Fp8Linear and type(w3) is Fp8Linear and w1.backend is w3.backend):
            return None
        if not _use_kernel(w1.backend, x) or torch_glue_forced():
            return None
        from moemesh.common.kernels.fp8_dequant import use_dequant_linear
        from moemesh.common.kernels.fp8_linear import fp8_gate_up_swiglu
        from moemesh.common.kernels.fp8_linear_config import DECODE_MAX_TOKENS

        num_tokens = x.numel() // x.shape[-1]
        if not 0 < num_tokens <= DECODE_MAX_TOKENS or use_dequant_linear(num_tokens):  # w1 would not run fp8_linear
            return None
        return fp8_gate_up_swiglu(x, w1.weight, w1.scale, w3.weight, w3.scale, swiglu_limit=self.limit)


class RoutedExperts:
    """Holds some (layer, expert) SwiGLU experts; computes the routed part of an MoE layer.

    weights: {(layer, expert): (w1 [I, D], w2 [D, I], w3 [I, D])} float tensors (hub layout).
    """

    def __init__(self, weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 swiglu_limit: float | None, *, route_weight_before_w2: bool = False) -> None:
        self._weights = dict(weights)
        self.swiglu_limit = swiglu_limit
        self.route_weight_before_w2 = route_weight_before_w2

    @classmethod
    def from_config(cls, weights, config: ModelConfig, numerics: NumericsConfig | None = None) -> "RoutedExperts":
        numerics = numerics or NumericsConfig()
        return cls(weights, config.swiglu_limit, route_weight_before_w2=numerics.route_weight_before_w2)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return sorted(self._weights)

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._weights

    def held_mask(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, K] -> bool [T, K]: which slots this holder can compute."""
        held = [e for (l, e) in self._weights if l == layer]
        if not held:
            return torch.zeros_like(ids, dtype=torch.bool)
        return torch.isin(ids, torch.tensor(held, device=ids.device))

    def _expert(self, layer: int, expert: int, x: torch.Tensor, route_weight: torch.Tensor) -> torch.Tensor:
        """x [N, D], route_weight [N] -> weighted output [N, D]."""
        w1, w2, w3 = self._weights[(layer, expert)]
        hidden = _swiglu(F.linear(x, w1), F.linear(x, w3), self.swiglu_limit)  # [N, I]
        if self.route_weight_before_w2:
            return F.linear(hidden * route_weight[:, None].to(hidden.dtype), w2)
        return F.linear(hidden, w2) * route_weight[:, None].to(hidden.dtype)

    def per_expert_outputs(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           slot_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted output of every (token, slot) -> [T, K, D]; zero where slot_mask is False.

        Every selected slot's expert must be held here (else ExpertNotHeld)."""
        selected = torch.ones_like(ids, dtype=torch.bool) if slot_mask is None else slot_mask
        out = hidden.new_zeros(ids.shape[0], ids.shape[1], hidden.shape[1])
        for expert in torch.unique(ids[selected]).tolist():  # ascending
            if (layer, expert) not in self._weights:
                raise ExpertNotHeld(f"expert ({layer}, {expert}) is not held here")
            token_idx, slot_idx = torch.where((ids == expert) & selected)
            out[token_idx, slot_idx] = self._expert(layer, expert, hidden[token_idx], weights[token_idx, slot_idx])
        return out

    def __call__(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D], ids/weights [T, K] -> routed sum [T, D]. Raises ExpertNotHeld."""
        return sum_slots_in_order(self.per_expert_outputs(layer, hidden, ids, weights))


class MultiHolderExperts:
    """Routes each slot to the first holder that has its expert, then sums slots in order.

    The single-process stand-in for dispatching to several expert workers."""

    def __init__(self, holders: list[RoutedExperts]) -> None:
        self.holders = list(holders)

    def __call__(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        slot_outputs = hidden.new_zeros(ids.shape[0], ids.shape[1], hidden.shape[1])
        assigned = torch.zeros_like(ids, dtype=torch.bool)
        for holder in self.holders:
            mask = holder.held_mask(layer, ids) & ~assigned
            if mask.any():
                part = holder.per_expert_outputs(layer, hidden, ids, weights, slot_mask=mask)
                slot_outputs = torch.where(mask[..., None], part, slot_outputs)
                assigned |= mask
        if not bool(assigned.all()):
            missing = sorted(set(ids[~assigned].tolist()))
            raise ExpertNotHeld(f"layer {layer}: experts {missing} are held by no holder")
        return sum_slots_in_order(slot_outputs)
