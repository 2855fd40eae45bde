"""Verification of sampled requests whose target distribution is softmax(logits / temperature) alone.

The same rule, the same streams and the same arithmetic as `verify.verify` (rejection sampling: accept draft
x_k when u_k · q_k(x_k) < p_k(x_k), u_k from (seed, VERIFY_ACCEPT, position); at the first rejection draw
from max(0, p_k - q_k) with (seed, VERIFY_RESAMPLE, position), after all drafts the bonus from p_W with
(seed, SAMPLE, position)), for requests without top-k, top-p, min-p, penalties, logit bias or logprobs
(`temperature_only`): with nothing else to apply, the ratio test runs on the host on the few values it reads
(p_k(x_k) from the device, q_k(x_k) from the relayed support), and the device only computes the target's
probabilities, the chosen rows' residuals and their draws: about twenty operators and two transfers for the
whole step instead of a [B, W1, V] pipeline with dense draft distributions. Outputs equal `verify.verify`'s
(tests/test_verify_sampled.py). Legend: S requests, N verified rows (sum of drafts + 1), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moemesh.common.sampling.draw import sample_from_probs
from moemesh.common.sampling.rng import Purpose, stream, uniform
from moemesh.common.sampling_params import SamplingParams


def temperature_only(params: SamplingParams, num_vocab: int) -> bool:
    """Sampled, and nothing but the temperature shapes its distribution (no logprobs asked either)."""
    return (not params.is_greedy and params.top_p >= 1.0 and (params.top_k is None or params.top_k >= num_vocab)
            and params.min_p <= 0.0 and not params.has_penalties and not params.logit_bias
            and params.num_logprobs is None)


@dataclass(frozen=True)
class SampledDrafts:
    """One request: its verified rows start at `first_row` of the step's logits (the seed slot, then one per
    draft); `support_ids[k]` / `support_probs[k]` are draft k's sparse q (the relayed float32 values)."""

    first_row: int
    draft_token_ids: Sequence[int]
    support_ids: Sequence[Sequence[int]]
    support_probs: Sequence[Sequence[float]]
    temperature: float
    seed: int
    first_position: int  # output position of draft slot 0


def _draft_q(request: SampledDrafts, slot: int) -> float:
    """q_slot(x_slot) from the support (0 when the drafted token is outside it, as the dense q has it)."""
    token = request.draft_token_ids[slot]
    for token_id, prob in zip(request.support_ids[slot], request.support_probs[slot]):
        if token_id == token:
            return prob
    return 0.0


def verify_sampled(logits: torch.Tensor, requests: Sequence[SampledDrafts]) -> list[tuple[int, list[int]]]:
    """logits [R, V] of the step -> (accepted drafts, emitted tokens) per request. The supports are the caller's
    to check (one per draft, ids in the vocabulary: draft_verification._check_supports)."""
    device = logits.device
    rows, temperatures, offsets = [], [], []
    for request in requests:
        offsets.append(len(rows))
        num_slots = len(request.draft_token_ids) + 1
        rows.extend(range(request.first_row, request.first_row + num_slots))
        temperatures.extend([request.temperature] * num_slots)
    draft_rows = [offset + k for offset, request in zip(offsets, requests) for k in range(len(request.draft_token_ids))]
    draft_tokens = [token for request in requests for token in request.draft_token_ids]
    num_rows, num_drafts_total = len(rows), len(draft_rows)
    # one host-to-device copy of the step's integer inputs: verified rows [N], drafted rows and tokens [2, D]
    table = torch.tensor(rows + draft_rows + draft_tokens, dtype=torch.int64).to(device, non_blocking=True)
    divisors = torch.tensor(temperatures, dtype=torch.float32).to(device, non_blocking=True).unsqueeze(1)
    probs = (logits.index_select(0, table[:num_rows]).float() / divisors).softmax(dim=-1)  # [N, V]
    p_drafted = []  # host sync 1: p_k(x_k) of every draft slot
    if draft_rows:
        p_drafted = probs[table[num_rows:num_rows + num_drafts_total], table[num_rows + num_drafts_total:]].tolist()
    accepted, chosen_rows, purposes, cursor = [], [], [], 0
    q_rows, q_ids, q_values = [], [], []  # the rejected slots' sparse q, to subtract from their rows
    for b, (offset, request) in enumerate(zip(offsets, requests)):
        num_drafts = len(request.draft_token_ids)
        p = torch.tensor(p_drafted[cursor:cursor + num_drafts], dtype=torch.float32)
        q = torch.tensor([_draft_q(request, k) for k in range(num_drafts)], dtype=torch.float32)
        u = torch.tensor([uniform(request.seed, Purpose.VERIFY_ACCEPT, request.first_position + k)
                          for k in range(num_drafts)], dtype=torch.float32)
        cursor += num_drafts
        passed = (u * q < p).tolist()  # float32 arithmetic, as verify.verify does it on the device
        count = passed.index(False) if False in passed else num_drafts
        accepted.append(count)
        chosen_rows.append(offset + count)
        purposes.append(Purpose.VERIFY_RESAMPLE if count < num_drafts else Purpose.SAMPLE)
        if count < num_drafts:
            q_rows.extend([b] * len(request.support_ids[count]))
            q_ids.extend(request.support_ids[count])
            q_values.extend(request.support_probs[count])
    # one copy: the chosen rows [S], then the rejected slots' support (row, id) pairs [2, Q]
    chosen_table = torch.tensor(chosen_rows + q_rows + q_ids, dtype=torch.int64).to(device, non_blocking=True)
    chosen = probs.index_select(0, chosen_table[:len(requests)])  # [S, V]
    residual = chosen
    if q_ids:
        num_q = len(q_ids)
        index = (chosen_table[len(requests):len(requests) + num_q], chosen_table[len(requests) + num_q:])
        negated = torch.tensor(q_values, dtype=torch.float32).neg_().to(device, non_blocking=True)  # [Q]
        residual = chosen.index_put(index, negated, accumulate=True).clamp_min_(0.0)  # max(0, p - q)
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, chosen)
    generators = [stream(request.seed, purpose, request.first_position + count, device)
                  for request, purpose, count in zip(requests, purposes, accepted)]
    final = sample_from_probs(residual, generators).tolist()  # host sync 2
    return [(count, [*request.draft_token_ids[:count], token])
            for request, count, token in zip(requests, accepted, final)]
