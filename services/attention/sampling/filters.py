"""Top-k, top-p and min-p filters on (temperature-scaled) logits.

Order, as in HF transformers' warpers: top-k, then top-p on what top-k left, then min-p.
A filtered token's logit becomes -inf. Every filter keeps at least the most likely token.

- top-k: keep exactly k tokens (the k largest; ties at the boundary broken by torch's sort).
- top-p: keep the smallest set of most likely tokens whose probability (after top-k,
  renormalised) reaches top_p: a token is dropped when the mass strictly before it in
  descending order is already >= top_p.
- min-p: keep tokens with p >= min_p * p_max, i.e. logit >= max_logit + log(min_p). A ratio to
  the maximum is unchanged by renormalisation, so min-p commutes with top-k / top-p masks.

Legend: R rows of the group, V vocabulary, K the group's largest k.
"""

from __future__ import annotations

import torch


def apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_ks[r] largest logits. logits [R, V], top_ks [R] int64 in [1, V].

    `max_top_k` (host int, >= every top_ks) sizes torch.topk, which is cheaper than a sort.
    """
    values, token_ids = torch.topk(logits, max_top_k, dim=-1)  # [R, K]
    rank = torch.arange(max_top_k, device=logits.device).unsqueeze(0)  # [1, K]
    kept = torch.where(rank < top_ks.unsqueeze(1), values, float("-inf"))  # [R, K]
    return torch.full_like(logits, float("-inf")).scatter_(1, token_ids, kept)


def apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Top-k (k = V disables it) then top-p, with one descending sort. [R, V] -> [R, V]."""
    sorted_logits, token_ids = torch.sort(logits, dim=-1, descending=True)  # [R, V]
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)  # [1, V]
    sorted_logits = sorted_logits.masked_fill(rank >= top_ks.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [R, V], descending
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    dropped = mass_before >= top_ps.unsqueeze(1)  # rank 0 has mass_before 0 < top_p: kept
    sorted_logits = sorted_logits.masked_fill(dropped, float("-inf"))
    return torch.empty_like(logits).scatter_(1, token_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's largest. [R, V] -> [R, V]."""
    max_logits = logits.max(dim=-1, keepdim=True).values  # [R, 1]
    threshold = max_logits + torch.log(min_ps).unsqueeze(1)  # [R, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))
