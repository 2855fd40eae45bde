"""How many tokens a request computes in one step, under the step budget and the caps."""

from __future__ import annotations

from moemesh.services.router.scheduler.config import SchedulerConfig
from moemesh.services.router.scheduler.request import Request
from moemesh.services.router.scheduler.stop_checks import max_output_tokens


def num_tokens_to_compute(request: Request, config: SchedulerConfig, budget: int) -> tuple[int, int]:
    """(tokens to compute this step, how many of them are drafts).

    The request's known tokens not yet computed come first, capped at
    long_prefill_token_threshold and at the remaining step budget. Drafts ride along only
    when the request has caught up (one known token left), and never past max_tokens:
    verifying k drafts yields up to k + 1 new tokens. Drafts that do not fit are dropped."""
    num_remaining = request.num_tokens - request.num_computed_tokens
    num_drafts = 0
    if num_remaining == 1 and request.draft_token_ids:
        num_output_left = max_output_tokens(request, config.max_model_len) - request.num_output_tokens
        num_drafts = max(0, min(len(request.draft_token_ids), num_output_left - 1))
    num_new = min(num_remaining + num_drafts, config.long_prefill_token_threshold, budget)
    return num_new, max(0, min(num_drafts, num_new - num_remaining))
