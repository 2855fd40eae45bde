"""Verification of drafts in the attention worker's step.

Drafts are extra tokens of their request (`ScheduledSequence.draft_token_ids`, the last ones of `token_ids`): the
layer loop runs them causally like any chunk, so the target's logits at the seed and at every draft position are
exactly the logits plain decoding would compute there. `verify_drafted` takes those W + 1 rows per request, runs
the lossless rule (greedy exact match + bonus, or rejection sampling against the sparse draft distributions the
router relays), appends the emitted tokens to the slot and rolls the `SequenceState` back by the rejected drafts,
so after the step the state equals plain decoding of the accepted tokens (window ring, compressor state,
compressed and indexer rows: `SequenceState.rollback` is exact). The scheduler frees the rejected drafts' blocks.
Three ways to the same tokens: greedy requests without bias, penalties or logprobs by one argmax over the step's
rows and a comparison on the host (`accept_by_argmax`); sampled requests whose distribution is the temperature
alone by `sampling.verify_sampled`; every other setting by the general verifier (`sampling.verify.verify`).
Legend: B drafted requests, W max drafts, W1 = W + 1, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.common.wire.messages import SequenceResult, TokenLogprobs


@dataclass(frozen=True)
class DraftedRow:
    """One drafted request of the step: its work item's slot and plan entry, and where its
    W_b + 1 logits rows start in the step's logits."""

    scheduled: object  # ScheduledSequence
    slot: object  # slots.Slot
    first_row: int


def verify_drafted(rows: list[DraftedRow], logits: torch.Tensor, argmax_rows: list[int] | None = None
                   ) -> tuple[dict[str, SequenceResult], dict[str, int]]:
    """Verify every drafted request. logits [R, V]: rows first_row .. first_row + W_b of
    request b score the seed slot and each draft slot. Returns (results by request id,
    rejected drafts by request id). Appends emitted tokens to each slot and rolls back its state.
    argmax_rows: the argmax of every logits row, when the caller has it and every request is `argmax_only`
    (the greedy rule then runs on the host)."""
    from moemesh.services.attention.sampling.verify_sampled import temperature_only

    num_drafts = [len(row.scheduled.draft_token_ids) for row in rows]
    _check_supports(rows, num_drafts, logits.shape[1])
    greedy = [argmax_only(row.slot.params) for row in rows]
    simple = [g or temperature_only(row.slot.params, logits.shape[1]) for g, row in zip(greedy, rows)]
    if all(simple):  # the argmax rule on the host, the temperature-only sampled rule (verify_sampled.py)
        accepted, emitted = _verify_simple(rows, num_drafts, logits, greedy, argmax_rows)
        logprobs = [None] * len(rows)
    else:
        accepted, emitted, logprobs = _verify_general(rows, num_drafts, logits)
    results, rejected = {}, {}
    for b, row in enumerate(rows):
        request_id = row.scheduled.request_id
        num_rejected = num_drafts[b] - accepted[b]
        if num_rejected:
            row.slot.state.rollback(num_rejected)
        row.slot.output_token_ids.extend(emitted[b])
        rejected[request_id] = num_rejected
        results[request_id] = SequenceResult(request_id, tuple(emitted[b]), num_draft_accepted=accepted[b],
                                             logprobs=logprobs[b])
    return results, rejected


def _check_supports(rows: list[DraftedRow], num_drafts: list[int], num_vocab: int) -> None:
    """Every sampled request's relayed draft distributions: one per draft, as many ids as probs, ids in the
    vocabulary (checked on the host: on a GPU a bad index would be a device assert). ValueError naming it."""
    for row, num in zip(rows, num_drafts):
        if row.slot.params.is_greedy:
            continue
        scheduled = row.scheduled
        supports, probs = scheduled.draft_support_token_ids, scheduled.draft_support_probs
        if len(supports) != num or len(probs) != num:
            raise ValueError(f"{scheduled.request_id}: {num} sampled drafts but {len(supports)} draft distributions")
        for k, (ids, values) in enumerate(zip(supports, probs)):
            if len(ids) != len(values):
                raise ValueError(f"{scheduled.request_id}: draft {k} has {len(ids)} ids, {len(values)} probs")
            if ids and (min(ids) < 0 or max(ids) >= num_vocab):
                raise ValueError(f"{scheduled.request_id}: draft {k}'s distribution has ids outside [0, {num_vocab})")


def argmax_only(params) -> bool:
    """Whether a request's token at a slot is the argmax of the raw logits: greedy, no logit bias, no
    penalties, no logprobs (process_logits leaves such a row as it is; grammar masks are applied before)."""
    return params.is_greedy and not params.logit_bias and not params.has_penalties and params.num_logprobs is None


def accept_by_argmax(rows: list[DraftedRow], num_drafts: list[int], targets: list[int]
                     ) -> tuple[list[int], list[list[int]]]:
    """The greedy rule on the host for requests whose target token is the raw argmax (`argmax_only`).
    targets: the argmax of every logits row of the step. -> (accepted, emitted) per request: the tokens
    `sampling.verify.verify` emits for them (torch.argmax's first maximum on ties)."""
    accepted, emitted = [], []
    for row, num in zip(rows, num_drafts):
        slot_targets = targets[row.first_row:row.first_row + num + 1]  # the seed slot, then each draft slot
        drafts = row.scheduled.draft_token_ids
        count = 0
        while count < num and drafts[count] == slot_targets[count]:
            count += 1
        accepted.append(count)
        emitted.append([*drafts[:count], slot_targets[count]])
    return accepted, emitted


def _verify_simple(rows: list[DraftedRow], num_drafts: list[int], logits: torch.Tensor, greedy: list[bool],
                   argmax_rows: list[int] | None) -> tuple[list[int], list[list[int]]]:
    """Requests that are each `argmax_only` or `temperature_only`: the first by `accept_by_argmax`, the others by
    `verify_sampled.verify_sampled`. -> (accepted, emitted) per request, in order."""
    from moemesh.services.attention.sampling.verify_sampled import SampledDrafts, verify_sampled

    accepted: list[int] = [0] * len(rows)
    emitted: list[list[int]] = [[] for _ in rows]
    greedy_at = [b for b, g in enumerate(greedy) if g]
    sampled_at = [b for b, g in enumerate(greedy) if not g]
    if greedy_at:
        if argmax_rows is None:
            argmax_rows = logits.argmax(dim=-1).tolist()  # [R]: the argmax of every row, one host sync
        counts, tokens = accept_by_argmax([rows[b] for b in greedy_at], [num_drafts[b] for b in greedy_at],
                                          argmax_rows)
        for b, count, emitted_b in zip(greedy_at, counts, tokens):
            accepted[b], emitted[b] = count, emitted_b
    if sampled_at:
        requests = []
        for b in sampled_at:
            scheduled, slot = rows[b].scheduled, rows[b].slot
            requests.append(SampledDrafts(rows[b].first_row, scheduled.draft_token_ids,
                                          scheduled.draft_support_token_ids, scheduled.draft_support_probs,
                                          slot.params.temperature, slot.seed, len(slot.output_token_ids)))
        for b, (count, emitted_b) in zip(sampled_at, verify_sampled(logits, requests)):
            accepted[b], emitted[b] = count, emitted_b
    return accepted, emitted


def _verify_general(rows: list[DraftedRow], num_drafts: list[int], logits: torch.Tensor
                    ) -> tuple[list[int], list[list[int]], list[TokenLogprobs | None]]:
    """Any sampling settings (`sampling.verify.verify`) -> (accepted, emitted, logprobs) per request."""
    from moemesh.services.attention.sampling.verify import verify

    num_requests = len(rows)
    num_vocab = logits.shape[1]
    device = logits.device
    max_drafts = max(num_drafts)
    index = torch.tensor([[row.first_row + min(k, n) for k in range(max_drafts + 1)]
                          for row, n in zip(rows, num_drafts)], dtype=torch.long, device=device)  # [B, W1]
    target_logits = logits[index]  # [B, W1, V]; padding slots repeat the bonus row, never used
    draft_ids = torch.zeros(num_requests, max_drafts, dtype=torch.long)
    for b, row in enumerate(rows):
        draft_ids[b, :num_drafts[b]] = torch.tensor(row.scheduled.draft_token_ids, dtype=torch.long)
    draft_probs = None
    if any(not row.slot.params.is_greedy for row in rows):
        draft_probs = _dense_draft_probs(rows, max_drafts, num_vocab, device)  # [B, W, V]
    out = verify(target_logits, draft_ids.to(device), draft_probs, [row.slot.params for row in rows],
                 [row.slot.seed for row in rows], [len(row.slot.output_token_ids) for row in rows],
                 [row.slot.prompt_token_ids for row in rows], [row.slot.output_token_ids for row in rows],
                 num_drafts)
    return (list(out.num_accepted), out.emitted_token_ids,
            [_logprobs(out, b, row.slot.params.num_logprobs) for b, row in enumerate(rows)])


def _dense_draft_probs(rows: list[DraftedRow], max_drafts: int, num_vocab: int, device: torch.device
                       ) -> torch.Tensor:
    """The sparse q of every sampled request's drafts, as the dense [B, W, V] fp32 the verifier
    takes (zeros for greedy rows and padding). One host-to-device copy and one scatter for the
    whole step (a copy per slot cost ~3 small transfers each on a GPU); the values are the relayed
    float32s, so q is bit for bit the distribution each draft was drawn from (checked by `_check_supports`)."""
    index_b, index_k, index_v, values = [], [], [], []
    for b, row in enumerate(rows):
        if row.slot.params.is_greedy:
            continue
        for k, (ids, probs) in enumerate(zip(row.scheduled.draft_support_token_ids,
                                             row.scheduled.draft_support_probs)):
            index_b.extend([b] * len(ids))
            index_k.extend([k] * len(ids))
            index_v.extend(ids)
            values.extend(probs)
    dense = torch.zeros(len(rows), max_drafts, num_vocab, dtype=torch.float32, device=device)
    if values:
        index = torch.tensor([index_b, index_k, index_v], dtype=torch.long).to(device)  # [3, N]
        dense[index[0], index[1], index[2]] = torch.tensor(values, dtype=torch.float32).to(device)
    return dense


def _logprobs(out, b: int, num_logprobs: int | None) -> TokenLogprobs | None:
    if num_logprobs is None or out.emitted_logprobs is None:
        return None
    num_emitted = len(out.emitted_token_ids[b])
    top_ids = top_values = ()
    if num_logprobs > 0 and out.top_logprob_ids is not None:
        top_ids = tuple(tuple(ids[:num_logprobs]) for ids in out.top_logprob_ids[b, :num_emitted].tolist())
        top_values = tuple(tuple(values[:num_logprobs]) for values in out.top_logprobs[b, :num_emitted].tolist())
    return TokenLogprobs(logprobs=tuple(out.emitted_logprobs[b]), top_token_ids=top_ids, top_logprobs=top_values)
