"""Per-row sampling settings of one batch: device tensors plus host-side row groups.

Built once per step from the requests' SamplingParams. The row groups (which rows need
penalties, top-k, top-p, min-p) are computed on the host from the params, so deciding what
work to do never reads a device tensor (no host sync). Legend: B rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moemesh.common.sampling_params import SamplingParams


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    if not rows:  # most groups of most steps: no host-to-device copy
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.tensor(list(rows), dtype=torch.int64).to(device, non_blocking=True)


def _floats(values: Sequence[float], device: torch.device) -> torch.Tensor:
    if not values:
        return torch.empty(0, dtype=torch.float32, device=device)
    return torch.tensor(list(values), dtype=torch.float32).to(device, non_blocking=True)


@dataclass(frozen=True)
class SamplingBatch:
    """Sampling settings of B rows.

    Invariants: `greedy_rows` and `sampled_rows` partition range(B). Filters (top-k, top-p,
    min-p) are only listed for sampled rows: they never change a greedy row's argmax.
    Each `*_rows` tuple is sorted and has a matching `*_index` int64 tensor on the device; the
    per-group setting tensors (`top_ks`, `top_ps`, `min_ps`, penalties) are aligned with their
    group, not with the whole batch.
    """

    num_rows: int
    temperatures: torch.Tensor  # [B] float32; 1.0 on greedy rows
    greedy_rows: tuple[int, ...]
    sampled_rows: tuple[int, ...]
    sampled_index: torch.Tensor  # [S]
    top_k_rows: tuple[int, ...]  # rows with top-k but no top-p (cheap torch.topk path)
    top_k_index: torch.Tensor
    top_ks: torch.Tensor  # [len(top_k_rows)] int64, each in [1, V]
    max_top_k: int  # largest of top_ks (0 when the group is empty); sizes torch.topk
    top_p_rows: tuple[int, ...]  # rows with top-p (and maybe top-k): full sort path
    top_p_index: torch.Tensor
    top_p_top_ks: torch.Tensor  # [len(top_p_rows)] int64; V where the row has no top-k
    top_ps: torch.Tensor  # [len(top_p_rows)] float32
    min_p_rows: tuple[int, ...]
    min_p_index: torch.Tensor
    min_ps: torch.Tensor  # [len(min_p_rows)] float32
    penalty_rows: tuple[int, ...]  # greedy or sampled rows with any penalty
    penalty_index: torch.Tensor
    presence_penalties: torch.Tensor  # [P] float32
    frequency_penalties: torch.Tensor  # [P] float32
    repetition_penalties: torch.Tensor  # [P] float32
    max_num_logprobs: int  # largest top-logprobs count asked by any row (0 if none)
    # logit_bias of every row, flattened: entry i adds bias_values[i] to logit
    # [bias_row_index[i], bias_token_index[i]]; empty when no row has a bias
    bias_row_index: torch.Tensor  # [N] int64
    bias_token_index: torch.Tensor  # [N] int64
    bias_values: torch.Tensor  # [N] float32

    @property
    def has_logit_bias(self) -> bool:
        return self.bias_values.numel() > 0

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], num_vocab: int, device: torch.device | str
    ) -> "SamplingBatch":
        device = torch.device(device)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        top_p = [i for i in sampled if params[i].top_p < 1.0]
        top_k = [
            i
            for i in sampled
            if params[i].top_k is not None and params[i].top_k < num_vocab and params[i].top_p >= 1.0
        ]
        min_p = [i for i in sampled if params[i].min_p > 0.0]
        penalty = [i for i, p in enumerate(params) if p.has_penalties]

        bias_entries = [(i, token_id, bias) for i, p in enumerate(params) for token_id, bias in p.logit_bias]
        if any(token_id >= num_vocab for _, token_id, _ in bias_entries):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {num_vocab}")

        def k_of(i: int) -> int:
            k = params[i].top_k
            return num_vocab if k is None else min(k, num_vocab)

        return cls(
            num_rows=len(params),
            temperatures=_floats([1.0 if p.is_greedy else p.temperature for p in params], device),
            greedy_rows=tuple(greedy),
            sampled_rows=tuple(sampled),
            sampled_index=_index(sampled, device),
            top_k_rows=tuple(top_k),
            top_k_index=_index(top_k, device),
            top_ks=_index([k_of(i) for i in top_k], device),
            max_top_k=max((k_of(i) for i in top_k), default=0),
            top_p_rows=tuple(top_p),
            top_p_index=_index(top_p, device),
            top_p_top_ks=_index([k_of(i) for i in top_p], device),
            top_ps=_floats([params[i].top_p for i in top_p], device),
            min_p_rows=tuple(min_p),
            min_p_index=_index(min_p, device),
            min_ps=_floats([params[i].min_p for i in min_p], device),
            penalty_rows=tuple(penalty),
            penalty_index=_index(penalty, device),
            presence_penalties=_floats([params[i].presence_penalty for i in penalty], device),
            frequency_penalties=_floats([params[i].frequency_penalty for i in penalty], device),
            repetition_penalties=_floats([params[i].repetition_penalty for i in penalty], device),
            max_num_logprobs=max((p.num_logprobs or 0 for p in params), default=0),
            bias_row_index=_index([i for i, _, _ in bias_entries], device),
            bias_token_index=_index([token_id for _, token_id, _ in bias_entries], device),
            bias_values=_floats([bias for _, _, bias in bias_entries], device),
        )
