"""Verification of draft tokens against the target: greedy exact match and rejection sampling.

Input per request b: the target's logits at W1 = W + 1 verified slots (slot k scores the token
after the committed context plus drafts 0..k-1; slot W is the bonus slot), up to W draft tokens
and, for sampled requests, the drafter's distributions p_d at each draft slot (Markov-corrected,
exactly the distributions the drafts were drawn from, docs/speculation.md §2.2).

Target processing: every slot's logits go through the same process_logits as the plain
sampler (sampler.py), with the penalty history extended by the drafts before that slot, so
p_t at slot k is what the sampler would have sampled from had drafts 0..k-1 been generated.

- greedy requests: accept the longest prefix with draft == argmax(processed target), then emit
  the target's argmax at the first mismatch (or at the bonus slot after all drafts).
- sampled requests: accept draft x_k with probability min(1, p_t(x_k) / p_d(x_k)), testing
  u * p_d(x_k) < p_t(x_k) with u ~ U[0, 1) from stream (seed, VERIFY_ACCEPT, position); at the
  first rejection draw from norm(max(0, p_t - p_d)) with stream (seed, VERIFY_RESAMPLE,
  position) and stop; if all drafts pass, draw the bonus from p_t with (seed, SAMPLE,
  position), the very stream plain sampling would use there (so zero drafts == plain sampling).
  The emitted sequence is then distributed exactly as plain sampling from p_t (lossless at any
  temperature / top-p / top-k / min-p / penalties), provided drafts were drawn from p_d with
  streams independent of these (Purpose.DRAFT; see rng.py).

Positions: `first_positions[b]` is the output position of draft slot 0 (the number of tokens
the request has generated so far); slot k is position first_positions[b] + k.

Host syncs: two per call, both needed to return Python lists: the accepted counts (they pick
the resample streams) and the final tokens. Legend: B requests, W draft slots, W1 = W + 1,
V vocabulary, S sampled requests, K top logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.sampling.batch import SamplingBatch
from moemesh.common.sampling.draw import sample_from_probs
from moemesh.services.attention.sampling.penalties import build_token_history, extend_with_drafts
from moemesh.common.sampling.rng import Purpose, stream, uniform
from moemesh.services.attention.sampling.sampler import process_logits


@dataclass(frozen=True)
class VerifyOutput:
    """What verification decided, per request.

    emitted_token_ids[b] = the num_accepted[b] accepted drafts + one target token; always
    num_accepted[b] + 1 tokens (stop tokens and max_tokens are the caller's to apply).
    accepted_mask[b, k] is True iff drafts 0..k were all accepted; with num_draft_tokens it gives
    acceptance by position for metrics. Logprobs (processed target distribution, as the sampler
    reports them) are present when any request asked for them.
    """

    num_accepted: tuple[int, ...]
    emitted_token_ids: list[list[int]]
    accepted_mask: torch.Tensor  # [B, W] bool
    num_draft_tokens: tuple[int, ...]
    emitted_logprobs: list[list[float]] | None
    top_logprob_ids: torch.Tensor | None  # [B, W1, K] int64, per verified slot
    top_logprobs: torch.Tensor | None  # [B, W1, K] float32


def _acceptance_uniforms(
    seeds: Sequence[int], first_positions: Sequence[int], num_slots: int, device: torch.device
) -> torch.Tensor:
    """u[s, k] from (seed, VERIFY_ACCEPT, first_position + k); computed on the host. [S, W]."""
    values = [
        [uniform(seed, Purpose.VERIFY_ACCEPT, position + k) for k in range(num_slots)]
        for seed, position in zip(seeds, first_positions)
    ]
    return torch.tensor(values, dtype=torch.float32).view(len(seeds), num_slots).to(device)


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    first_positions: Sequence[int],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    num_draft_tokens: Sequence[int] | None = None,
) -> VerifyOutput:
    """Verify drafts of B requests. Shapes: target_logits [B, W1, V], draft_token_ids [B, W],
    draft_probs [B, W, V] or None (allowed only when no sampled request has drafts).

    seeds[b] may be None only for greedy requests. num_draft_tokens[b] <= W gives a request
    fewer drafts (the rest are padding, ignored); its bonus slot is then num_draft_tokens[b].
    The id lists matter only for requests with penalties.
    """
    num_requests, num_slots, num_vocab = target_logits.shape  # B, W1, V
    num_drafts_max = num_slots - 1  # W
    device = target_logits.device
    if draft_token_ids.shape != (num_requests, num_drafts_max):
        raise ValueError(f"draft_token_ids {tuple(draft_token_ids.shape)} != {(num_requests, num_drafts_max)}")
    if not len(params) == len(seeds) == len(first_positions) == num_requests:
        raise ValueError(f"{num_requests} requests; every per-request argument needs as many")
    num_drafts = tuple(num_draft_tokens) if num_draft_tokens is not None else (num_drafts_max,) * num_requests
    if len(num_drafts) != num_requests or not all(0 <= n <= num_drafts_max for n in num_drafts):
        raise ValueError(f"num_draft_tokens must be {num_requests} values in [0, {num_drafts_max}]")
    sampled = [b for b, p in enumerate(params) if not p.is_greedy]
    if any(seeds[b] is None for b in sampled):
        raise ValueError("every sampled request needs a seed")
    if draft_probs is None and any(num_drafts[b] > 0 for b in sampled):
        raise ValueError("sampled requests with drafts need draft_probs")

    # padding slots hold token 0, so scatters stay in range; they are never accepted
    num_drafts_t = torch.tensor(num_drafts, dtype=torch.int64).to(device)  # [B]
    slot_valid = torch.arange(num_drafts_max, device=device).unsqueeze(0) < num_drafts_t.unsqueeze(1)
    drafts = torch.where(slot_valid, draft_token_ids.to(device), 0)  # [B, W]

    processed = _process_slots(target_logits, drafts, params, prompt_token_ids, output_token_ids)
    target_argmax = processed.argmax(dim=-1)  # [B, W1]
    accepted = drafts == target_argmax[:, :num_drafts_max]  # [B, W], the greedy rule

    sampled_index = torch.tensor(sampled, dtype=torch.int64).to(device)  # [S]
    probs_t = probs_d = None
    if sampled:
        probs_t = processed.index_select(0, sampled_index).softmax(dim=-1)  # [S, W1, V]
        if draft_probs is not None and num_drafts_max > 0:
            probs_d = draft_probs.index_select(0, sampled_index).float()  # [S, W, V]
            sampled_drafts = drafts.index_select(0, sampled_index).unsqueeze(2)  # [S, W, 1]
            p_target = probs_t[:, :num_drafts_max].gather(2, sampled_drafts).squeeze(2)  # [S, W]
            p_draft = probs_d.gather(2, sampled_drafts).squeeze(2)  # [S, W]
            u = _acceptance_uniforms(
                [seeds[b] for b in sampled], [first_positions[b] for b in sampled], num_drafts_max, device
            )
            accepted = accepted.index_copy(0, sampled_index, u * p_draft < p_target)
    accepted_mask = (accepted & slot_valid).long().cumprod(dim=1).bool()  # [B, W]
    num_accepted_t = accepted_mask.sum(dim=1)  # [B]
    num_accepted = tuple(num_accepted_t.tolist())  # host sync 1: picks the resample streams

    final = target_argmax.gather(1, num_accepted_t.unsqueeze(1)).squeeze(1)  # [B], greedy rule
    if sampled:
        drawn = _draw_final_sampled(
            probs_t, probs_d, num_accepted_t.index_select(0, sampled_index),
            [(seeds[b], first_positions[b], num_accepted[b], num_drafts[b]) for b in sampled],
            num_drafts_t.index_select(0, sampled_index),
        )
        final = final.index_copy(0, sampled_index, drawn)

    slot = torch.arange(num_slots, device=device).unsqueeze(0)  # [1, W1]
    padded_drafts = torch.cat([drafts, drafts.new_zeros(num_requests, 1)], dim=1)  # [B, W1]
    emitted = torch.where(slot < num_accepted_t.unsqueeze(1), padded_drafts, final.unsqueeze(1))
    emitted_rows = emitted.tolist()  # host sync 2
    emitted_token_ids = [row[: n + 1] for row, n in zip(emitted_rows, num_accepted)]

    emitted_logprobs = top_ids = top_values = None
    if any(p.num_logprobs is not None for p in params):
        log_probs = processed.log_softmax(dim=-1)  # [B, W1, V]
        chosen = log_probs.gather(2, emitted.unsqueeze(2)).squeeze(2).tolist()  # [B, W1]
        emitted_logprobs = [row[: n + 1] for row, n in zip(chosen, num_accepted)]
        max_top = max(p.num_logprobs or 0 for p in params)
        if max_top > 0:
            top_values, top_ids = torch.topk(log_probs, min(max_top, num_vocab), dim=-1)
    return VerifyOutput(
        num_accepted=num_accepted,
        emitted_token_ids=emitted_token_ids,
        accepted_mask=accepted_mask,
        num_draft_tokens=num_drafts,
        emitted_logprobs=emitted_logprobs,
        top_logprob_ids=top_ids,
        top_logprobs=top_values,
    )


def _process_slots(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """process_logits on every slot, slot k's penalties counting drafts 0..k-1. -> [B, W1, V]."""
    num_requests, num_slots, num_vocab = target_logits.shape
    slot_params = [p for p in params for _ in range(num_slots)]  # row b * W1 + k
    batch = SamplingBatch.from_params(slot_params, num_vocab, target_logits.device)
    history = None
    penalty_requests = [b for b, p in enumerate(params) if p.has_penalties]
    if penalty_requests:
        base = build_token_history(
            [prompt_token_ids[b] for b in penalty_requests],
            [output_token_ids[b] for b in penalty_requests],
            num_vocab,
            target_logits.device,
        )
        index = torch.tensor(penalty_requests, dtype=torch.int64).to(target_logits.device)
        history = extend_with_drafts(base, drafts.index_select(0, index))
    flat = target_logits.reshape(num_requests * num_slots, num_vocab)
    return process_logits(flat, batch, history).view(num_requests, num_slots, num_vocab)


def _draw_final_sampled(
    probs_t: torch.Tensor,
    probs_d: torch.Tensor | None,
    num_accepted: torch.Tensor,
    rows: Sequence[tuple[int, int, int, int]],
    num_drafts: torch.Tensor,
) -> torch.Tensor:
    """The token after the accepted drafts of each sampled request. -> [S] int64.

    probs_t [S, W1, V], probs_d [S, W, V] or None, num_accepted [S] (device), rows = host
    (seed, first_position, num_accepted, num_drafts) per request, num_drafts [S] (device).
    A rejection at slot n draws from max(0, p_t - p_d) at n; after all drafts, p_d counts as 0
    and the draw is from p_t at the bonus slot. If rounding leaves the residual all zero
    (p_d == p_t, where rejection has probability 0), p_t is used.
    """
    num_sampled, _, num_vocab = probs_t.shape
    gather_index = num_accepted.view(num_sampled, 1, 1).expand(num_sampled, 1, num_vocab)
    p_target = probs_t.gather(1, gather_index).squeeze(1)  # [S, V]
    residual = p_target
    if probs_d is not None:
        is_rejection = (num_accepted < num_drafts).unsqueeze(1)  # [S, 1]
        clamped_index = gather_index.clamp_max(probs_d.shape[1] - 1)
        p_draft = probs_d.gather(1, clamped_index).squeeze(1)  # [S, V]
        p_draft = torch.where(is_rejection, p_draft, 0.0)
        residual = (p_target - p_draft).clamp_min(0.0)
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_target)
    generators = [
        stream(
            seed,
            Purpose.VERIFY_RESAMPLE if accepted < drafted else Purpose.SAMPLE,
            position + accepted,
            probs_t.device,
        )
        for seed, position, accepted, drafted in rows
    ]
    return sample_from_probs(residual, generators)
