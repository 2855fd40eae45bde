"""Group routed (token, slot) pairs by expert and run each expert once on its group.

The selected (t, k) pairs are flattened in token-major order and stably sorted by expert id,
so each expert sees a contiguous group whose rows are in ascending token order: exactly the
rows, in exactly the order, that the single-process `RoutedExperts.per_expert_outputs` gives
the same expert. The per-row math (SwiGLU with the model's clamp, route weight before or
after w2) is the reference's, so every slot output is bit-identical to the reference's.
Legend: T tokens, K top-k slots, D hidden, I expert width, P selected pairs, G experts in a group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertGroups:
    """Selected pairs sorted by expert: pair j is (token_index[j], slot_index[j]); group g covers
    pairs offsets[g] ..< offsets[g+1] and is expert expert_ids[g] (ascending)."""

    token_index: torch.Tensor  # [P] int64
    slot_index: torch.Tensor  # [P] int64
    expert_ids: list[int]  # [G] host ints, ascending
    offsets: list[int]  # [G + 1] host ints

    def moved(self, to_device) -> "ExpertGroups":
        """The same groups with both index tensors moved by `to_device` (one upload of [2, P])."""
        both = to_device(torch.stack([self.token_index, self.slot_index]))  # [2, P]
        return ExpertGroups(both[0], both[1], self.expert_ids, self.offsets)


def group_by_expert(ids: torch.Tensor, slot_mask: torch.Tensor | None) -> ExpertGroups:
    """ids [T, K] int, slot_mask [T, K] bool (None: all) -> groups (one host sync for the counts when
    ids are on a device; none for host ids, which the expert worker groups before uploading)."""
    num_slots = ids.shape[1]
    flat_ids = ids.reshape(-1).long()  # [T·K]
    flat_pairs = torch.arange(flat_ids.shape[0], device=ids.device)
    if slot_mask is not None:
        keep = slot_mask.reshape(-1)
        flat_ids, flat_pairs = flat_ids[keep], flat_pairs[keep]
    order = torch.sort(flat_ids, stable=True).indices  # stable: tokens stay ascending per expert
    sorted_ids = flat_ids[order]
    sorted_pairs = flat_pairs[order]
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    offsets = [0]
    for count in counts.tolist():
        offsets.append(offsets[-1] + count)
    return ExpertGroups(sorted_pairs // num_slots, sorted_pairs % num_slots, experts.tolist(), offsets)


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, route_weight: torch.Tensor,
                  swiglu_limit: float | None, route_weight_before_w2: bool) -> torch.Tensor:
    """x [N, D], w1/w3 [I, D], w2 [D, I], route_weight [N] -> weighted output [N, D] (docs/model.md §2.9)."""
    gate, up = F.linear(x, w1), F.linear(x, w3)  # [N, I]
    if swiglu_limit:  # gate clamped from above only, up both ways
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    hidden = F.silu(gate) * up
    weight = route_weight[:, None].to(hidden.dtype)
    if route_weight_before_w2:
        return F.linear(hidden * weight, w2)
    return F.linear(hidden, w2) * weight


def slot_outputs(weights_of: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], layer: int,
                 hidden: torch.Tensor, groups: ExpertGroups, route_weights: torch.Tensor, num_slots: int,
                 swiglu_limit: float | None, route_weight_before_w2: bool) -> torch.Tensor:
    """Weighted output of every selected (token, slot) -> [T, K, D], zero elsewhere.

    KeyError if a group's expert is not in `weights_of` (the caller checks ownership first)."""
    out = hidden.new_zeros(hidden.shape[0], num_slots, hidden.shape[1])  # [T, K, D]
    for group, expert in enumerate(groups.expert_ids):
        begin, end = groups.offsets[group], groups.offsets[group + 1]
        token_index = groups.token_index[begin:end]
        slot_index = groups.slot_index[begin:end]
        w1, w2, w3 = (w.to(hidden.dtype) for w in weights_of[(layer, expert)])  # held bf16: one expert cast
        out[token_index, slot_index] = swiglu_expert(
            hidden[token_index], w1, w2, w3, route_weights[token_index, slot_index], swiglu_limit,
            route_weight_before_w2)
    return out

