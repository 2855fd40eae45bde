"""Applying a step's sampled tokens to a request: consistency checks, stop conditions.

A verification step may return several tokens at once; the request ends at the first one
that is a stop token, an EOS (unless ignore_eos), the one that completes the request's
grammar (constrained decoding: STOP), or the one that reaches the length limit, and the
tokens after it are dropped (they were never meant to exist).
"""

from __future__ import annotations

from collections.abc import Sequence

from moemesh.services.router.scheduler.output import ScheduledSequence, SequenceResult
from moemesh.services.router.scheduler.request import FinishReason, Request


def max_output_tokens(request: Request, max_model_len: int) -> int:
    """Output tokens the request may still reach in total: max_tokens bounded by the model length."""
    return min(request.sampling_params.max_tokens, max_model_len - request.num_prompt_tokens)


def append_sampled_tokens(
    request: Request, sampled_token_ids: Sequence[int], max_model_len: int
) -> tuple[list[int], FinishReason | None]:
    """Append tokens in order until one ends the request. Returns (appended, finish reason)."""
    params = request.sampling_params
    limit = max_output_tokens(request, max_model_len)
    appended: list[int] = []
    for token_id in sampled_token_ids:
        request.output_token_ids.append(token_id)
        appended.append(token_id)
        if token_id in params.stop_token_ids:
            return appended, FinishReason.STOP
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return appended, FinishReason.STOP
        if request.guide is not None:
            reason = request.guide.advance(token_id)
            if reason is not None:
                return appended, reason
        if request.num_output_tokens >= limit:
            return appended, FinishReason.LENGTH
    return appended, None


def result_problem(seq: ScheduledSequence, result: SequenceResult | None) -> str | None:
    """Why a sampled sequence's result cannot be applied, or None if it can."""
    if result is None:
        return "no result for a sampled sequence"
    if result.error is not None:
        return result.error
    num_drafts = len(seq.draft_token_ids)
    if not 0 <= result.num_accepted_drafts <= num_drafts:
        return f"{result.num_accepted_drafts} drafts accepted of {num_drafts}"
    if len(result.sampled_token_ids) != result.num_accepted_drafts + 1:
        return f"{len(result.sampled_token_ids)} tokens for {result.num_accepted_drafts} accepted drafts"
    num_accepted = result.num_accepted_drafts
    if tuple(result.sampled_token_ids[:num_accepted]) != seq.draft_token_ids[:num_accepted]:
        return "accepted tokens differ from the drafts"
    return None
