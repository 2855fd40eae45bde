"""The attention worker's step, after the layers: logits of the rows that sample, grammar masks, then plain
sampling or verification of drafts.

A sequence that samples this step contributes one logits row, or 1 + its drafts rows when it verifies
drafts (the seed slot and every draft slot), in plan order. `sampling_logits` takes them from a step graph's
logits when those are exactly the rows (a decode or verification step replayed whole) and computes the head
on just those rows otherwise; `masked_logits` applies each constrained sequence's grammar masks to its rows,
so the sampler and the verifier both see the constrained distribution; `sample_or_verify` verifies every
drafted sequence (draft_verification.verify_drafted, which rolls back the rejected drafts) and samples the others
from their one row. `token_mask_problem` is the plan check `_prepare` runs on each sequence's mask rows.
work items carry `.scheduled` (ScheduledSequence) and `.slot` (slots.Slot). Legend: B sequences that
sample, V vocab, T step tokens.
"""

from __future__ import annotations

import torch

from moemesh.common.wire.messages import SequenceResult, TokenLogprobs


def sampling_logits(work: list, groups: list[range], finals: list[torch.Tensor], step_logits: torch.Tensor | None,
                    side, device: torch.device) -> torch.Tensor | None:
    """Logits [R, V] of every sampling row in plan order. finals: each micro-batch's final streams [T_i, N, D];
    step_logits: [T, V] of every row from a step graph (one micro-batch), else None; side: the AttentionSide
    whose head computes the rows otherwise."""
    rows = []
    for group, h in zip(groups, finals):
        ends = []
        offset = 0
        for index in group:
            offset += len(work[index].scheduled.token_ids)
            if work[index].scheduled.do_sample:  # the seed slot and every draft slot
                ends.extend(range(offset - 1 - len(work[index].scheduled.draft_token_ids), offset))
        if step_logits is not None and ends == list(range(step_logits.shape[0])):
            rows.append(step_logits)
        elif ends:
            rows.append(side.logits(h, torch.tensor(ends, device=device)))  # [b, V]
    return torch.cat(rows) if rows else None


def masked_logits(work: list, logits: torch.Tensor | None, token_masks: torch.Tensor | None) -> torch.Tensor | None:
    """The sampling logits with each constrained sequence's grammar masks applied to its rows
    (sampling/token_masks.py)."""
    if token_masks is None or logits is None:
        return logits
    from moemesh.services.attention.sampling.token_masks import apply_token_masks

    logit_rows, mask_rows, row = [], [], 0
    for item in work:
        if not item.scheduled.do_sample:
            continue
        num_rows = 1 + len(item.scheduled.draft_token_ids)
        if item.scheduled.token_mask_row is not None:
            logit_rows.extend(range(row, row + num_rows))
            mask_rows.extend(range(item.scheduled.token_mask_row, item.scheduled.token_mask_row + num_rows))
        row += num_rows
    return apply_token_masks(logits, token_masks, logit_rows, mask_rows)


def sample_or_verify(work: list, logits: torch.Tensor | None, sampler, device: torch.device
                     ) -> tuple[dict[str, SequenceResult], dict[str, int]]:
    """(results by request id, rejected drafts by request id). Sequences with drafts are verified
    (draft_verification.verify_drafted), the others sampled from their one row by `sampler` (sampling.Sampler). When
    every row is a plain argmax (`draft_verification.argmax_only`: greedy, no bias, penalties or logprobs), one argmax
    over the rows and one host transfer decide them all, what the sampler and the verifier would choose."""
    from moemesh.common.sampling.rng import Purpose, stream
    from moemesh.services.attention.draft_verification import DraftedRow, argmax_only, verify_drafted

    results = {item.scheduled.request_id: SequenceResult(item.scheduled.request_id, ()) for item in work
               if not item.scheduled.do_sample}
    sampling, plain_rows, drafted, row = [], [], [], 0
    for item in work:
        if not item.scheduled.do_sample:
            continue
        if item.scheduled.draft_token_ids:
            drafted.append(DraftedRow(item.scheduled, item.slot, row))
        else:
            sampling.append(item)
            plain_rows.append(row)
        row += 1 + len(item.scheduled.draft_token_ids)
    rejected: dict[str, int] = {}
    argmax_rows = None
    if logits is not None and all(argmax_only(item.slot.params) for item in work if item.scheduled.do_sample):
        argmax_rows = logits.argmax(dim=-1).tolist()  # [R]: every row's token, the step's one host sync
    if drafted:
        verified, rejected = verify_drafted(drafted, logits, argmax_rows)
        results.update(verified)
    if not sampling:
        return results, rejected
    if argmax_rows is not None:
        for item, row in zip(sampling, plain_rows):
            item.slot.output_token_ids.append(argmax_rows[row])
            results[item.scheduled.request_id] = SequenceResult(item.scheduled.request_id, (argmax_rows[row],))
        return results, rejected
    if drafted:
        logits = logits.index_select(0, torch.tensor(plain_rows, device=logits.device))  # [B, V]
    slots = [item.slot for item in sampling]
    generators = [None if slot.seed is None else stream(slot.seed, Purpose.SAMPLE, len(slot.output_token_ids),
                                                        device) for slot in slots]
    out = sampler.sample(logits, [s.params for s in slots], generators,
                         [s.prompt_token_ids for s in slots], [s.output_token_ids for s in slots])
    token_ids = out.token_ids.tolist()  # the one host sync the step needs
    wants_logprobs = any(slot.params.num_logprobs is not None for slot in slots)
    chosen = out.logprobs.tolist() if wants_logprobs else None
    top_ids = out.top_logprob_ids.tolist() if wants_logprobs else None
    top_values = out.top_logprobs.tolist() if wants_logprobs else None
    for row, (item, slot) in enumerate(zip(sampling, slots)):
        slot.output_token_ids.append(token_ids[row])
        logprobs = None
        if slot.params.num_logprobs is not None:
            k = slot.params.num_logprobs
            logprobs = TokenLogprobs(logprobs=(chosen[row],), top_token_ids=(tuple(top_ids[row][:k]),),
                                     top_logprobs=(tuple(top_values[row][:k]),))
        results[item.scheduled.request_id] = SequenceResult(item.scheduled.request_id, (token_ids[row],),
                                                            logprobs=logprobs)
    return results, rejected


def token_mask_problem(scheduled, token_masks: torch.Tensor | None) -> str | None:
    """Why a sequence's grammar mask rows cannot be applied (a malformed plan), or None."""
    first = scheduled.token_mask_row
    if first is None:
        return None
    num_rows = 1 + len(scheduled.draft_token_ids)
    if not scheduled.do_sample or token_masks is None or token_masks.dim() != 2 or token_masks.dtype != torch.int32:
        return "token_mask_row without int32 [M, words] token_masks on a sampled sequence"
    if not 0 <= first <= token_masks.shape[0] - num_rows:
        return f"token mask rows {first}..{first + num_rows} outside the plan's {token_masks.shape[0]}"
    return None
