"""Drawing tokens from distributions with per-row random streams (exponential-race / Gumbel-max).

Both the target sampler and the drafter draw through these helpers, so the same stream and the
same distribution always give the same token, whatever the batch.

The method: with E_v ~ Exp(1) i.i.d., argmax_v p_v / E_v is distributed as p (the first of
independent exponential clocks with rates p_v to ring). Equivalently argmax_v (logit_v - log E_v)
samples softmax(logits): -log E is Gumbel noise. Tokens with p_v = 0 (logit -inf) can never be
chosen, and p need not be normalised, which is what the verifier's residual max(0, p_t - p_d)
wants. Each row draws its V exponentials from its own generator into a fresh buffer, so a row's
noise does not depend on its place in the batch.

Legend: R rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Exp(1) draws are clamped away from 0: a zero would make p / E infinite (or NaN for p = 0).
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny


def exponential_noise(
    generators: Sequence[torch.Generator], num_vocab: int, device: torch.device
) -> torch.Tensor:
    """Exp(1) noise, one row per generator. Returns [R, V] float32, all entries > 0.

    A Python loop over rows (not vocabulary): torch generators are per row by design.
    """
    if not generators:
        return torch.empty(0, num_vocab, dtype=torch.float32, device=device)
    rows = [
        torch.empty(num_vocab, dtype=torch.float32, device=device).exponential_(generator=g)
        for g in generators
    ]
    return torch.stack(rows).clamp_min_(_MIN_EXPONENTIAL)  # [R, V]


def sample_from_probs(
    probs: torch.Tensor, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Draw one token per row from (possibly unnormalised) non-negative weights.

    probs [R, V] (any float dtype; computed in float32), one generator per row.
    Returns [R] int64. A row of all zeros returns token 0: callers must not pass one.
    """
    if probs.dim() != 2 or probs.shape[0] != len(generators):
        raise ValueError(f"probs {tuple(probs.shape)} needs one generator per row")
    noise = exponential_noise(generators, probs.shape[1], probs.device)  # [R, V]
    return (probs.float() / noise).argmax(dim=-1)


def sample_from_logits(
    logits: torch.Tensor, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Draw one token per row from softmax(logits). logits [R, V] (-inf allowed). Returns [R]."""
    if logits.dim() != 2 or logits.shape[0] != len(generators):
        raise ValueError(f"logits {tuple(logits.shape)} needs one generator per row")
    noise = exponential_noise(generators, logits.shape[1], logits.device)  # [R, V]
    return (logits.float() - noise.log_()).argmax(dim=-1)
