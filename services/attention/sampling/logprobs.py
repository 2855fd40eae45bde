"""Log-probabilities reported to the client.

Which distribution: the *processed* one, i.e. log_softmax of the logits the token was drawn
from: penalties, then temperature, then top-k / top-p / min-p (filtered tokens get -inf).
Greedy rows report log_softmax of the penalised logits (temperature taken as 1, filters
skipped: they cannot change an argmax). The verifier reports the same quantity for the tokens
it emits, so speculation does not change reported logprobs.

Legend: R rows, V vocabulary, K top logprobs per row.
"""

from __future__ import annotations

import torch


def chosen_logprobs(processed_logits: torch.Tensor, token_ids: torch.Tensor,
                    log_norm: torch.Tensor | None = None) -> torch.Tensor:
    """log p(token) per row: processed_logits [R, V], token_ids [R] -> [R] float32. log_norm [R]: the rows'
    logsumexp when the caller has it."""
    if log_norm is None:
        log_norm = torch.logsumexp(processed_logits, dim=-1)  # [R]
    chosen = processed_logits.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [R]
    return chosen - log_norm


def top_logprobs(
    processed_logits: torch.Tensor, num_top: int, log_norm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The num_top most likely tokens per row and their logprobs: ([R, K] int64, [R, K] fp32).

    Ordered by decreasing logprob. Rows that asked for fewer take a prefix.
    """
    num_top = min(num_top, processed_logits.shape[1])
    if log_norm is None:  # [R, 1]: the rows' logsumexp
        log_norm = torch.logsumexp(processed_logits, dim=-1, keepdim=True)
    values, token_ids = torch.topk(processed_logits, num_top, dim=-1)  # [R, K]
    return token_ids, values - log_norm
