"""How many tokens a request computes in one step, under the step budget and the caps."""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.services.router.scheduler.config import SchedulerConfig
from moemesh.services.router.scheduler.request import Request
from moemesh.services.router.scheduler.stop_checks import max_output_tokens


@dataclass(frozen=True)
class StepChunking:
    """What caps a request's chunk in one step, decided once at its start: short requests are about
    (short_requests.py), and the step may size short prefills for the attention worker's graphs
    (`graph_chunks_fit`)."""

    short_requests_about: bool = False
    graph_chunks: bool = False


def graph_chunks_fit(config: SchedulerConfig, num_live_sequences: int) -> bool:
    """Whether a step may size short prefills for the attention worker's graphs: with every live sequence
    bringing at most graph_chunk_tokens, the step stays within graph_step_tokens (more sequences: the step may
    run eagerly, where a short prompt's whole chunk costs no more than a piece of it)."""
    step_tokens = num_live_sequences * config.graph_chunk_tokens
    return bool(config.graph_chunk_tokens) and step_tokens <= config.graph_step_tokens


def chunk_cap(request: Request, config: SchedulerConfig, chunking: StepChunking, num_computed: int | None = None
              ) -> int:
    """The most tokens the request computes in one step: long_prefill_token_threshold, or
    shared_prefill_token_threshold for a prompt longer than that while short requests are about, or, in a step
    that sizes short prefills for graphs, graph_chunk_tokens while at most graph_prefill_token_threshold of its
    known tokens are left to compute (more than one: a decode step and its drafts are not capped here).
    num_computed: the tokens it will have computed before this step (default: request.num_computed_tokens; at
    admission, its cached prefix)."""
    num_left = request.num_tokens - (request.num_computed_tokens if num_computed is None else num_computed)
    if chunking.graph_chunks and 1 < num_left <= config.graph_prefill_token_threshold:
        return min(config.long_prefill_token_threshold, config.graph_chunk_tokens)
    if chunking.short_requests_about and request.num_prompt_tokens > config.long_prefill_token_threshold:
        return min(config.long_prefill_token_threshold, config.shared_prefill_token_threshold)
    return config.long_prefill_token_threshold


def num_tokens_to_compute(request: Request, config: SchedulerConfig, budget: int,
                          chunking: StepChunking = StepChunking()) -> tuple[int, int]:
    """(tokens to compute this step, how many of them are drafts).

    The request's known tokens not yet computed come first, capped by `chunk_cap` and at the remaining
    step budget. Drafts ride along only when the request has caught up (one known token left), and never
    past max_tokens: verifying k drafts yields up to k + 1 new tokens. Drafts that do not fit are dropped."""
    num_remaining = request.num_tokens - request.num_computed_tokens
    num_drafts = 0
    if num_remaining == 1 and request.draft_token_ids:
        num_output_left = max_output_tokens(request, config.max_model_len) - request.num_output_tokens
        num_drafts = max(0, min(len(request.draft_token_ids), num_output_left - 1))
    num_new = min(num_remaining + num_drafts, chunk_cap(request, config, chunking), budget)
    return num_new, max(0, min(num_drafts, num_new - num_remaining))
