"""Goodness of fit of sampled token counts to a distribution (Pearson chi-square).

Used by the sampler, verifier and speculation-distribution tests. Torch only (no scipy): the p-value is the regularised upper incomplete gamma.
"""

from __future__ import annotations

import torch

# Cells with a smaller expected count are pooled into one, where the chi-square approximation holds.
MIN_EXPECTED_COUNT = 5.0


def chi_square_p_value(observed_counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of observing `observed_counts` [C] if samples follow `expected_probs` [C].

    Any observation in a cell of probability 0 gives 0.0 (impossible under the hypothesis).
    """
    observed = observed_counts.double().flatten()
    probs = expected_probs.double().flatten()
    if observed.shape != probs.shape:
        raise ValueError(f"{observed.shape} counts vs {probs.shape} probabilities")
    probs = probs / probs.sum()
    if bool((observed[probs == 0] > 0).any()):
        return 0.0
    expected = probs * observed.sum()
    large = expected >= MIN_EXPECTED_COUNT
    cells_observed = observed[large]
    cells_expected = expected[large]
    if bool((~large & (probs > 0)).any()):
        cells_observed = torch.cat([cells_observed, observed[~large].sum().view(1)])
        cells_expected = torch.cat([cells_expected, expected[~large].sum().view(1)])
    degrees = cells_observed.numel() - 1
    if degrees < 1:
        return 1.0
    statistic = ((cells_observed - cells_expected) ** 2 / cells_expected).sum()
    return float(torch.special.gammaincc(torch.tensor(degrees / 2.0, dtype=torch.float64), statistic / 2.0))
