"""Empirical frequencies of sampled tokens match the processed distribution (chi-square)."""

import pytest
import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.sampling.draw import sample_from_probs
from moemesh.common.sampling.rng import Purpose, stream
from moemesh.services.attention.sampling.sampler import Sampler
from chi_square_support import chi_square_p_value

NUM_VOCAB = 12
NUM_SAMPLES = 20000


def _row_logits() -> torch.Tensor:
    return torch.randn(NUM_VOCAB, generator=torch.Generator().manual_seed(42)) * 1.5


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-p, min-p written out plainly on one row."""
    probs = (logits / params.temperature).softmax(-1)
    keep = torch.ones(NUM_VOCAB, dtype=torch.bool)
    if params.top_p < 1.0:
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(0) - probs[order]
        keep[order[mass_before >= params.top_p]] = False
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def _sample_counts(params: SamplingParams) -> torch.Tensor:
    """NUM_SAMPLES rows, each its own request seed, in one batch."""
    logits = _row_logits().expand(NUM_SAMPLES, NUM_VOCAB)
    all_params = [SamplingParams(**{**params.to_wire(), "seed": s}) for s in range(NUM_SAMPLES)]
    gens = [stream(s, Purpose.SAMPLE, 0) for s in range(NUM_SAMPLES)]
    empty = [[]] * NUM_SAMPLES
    out = Sampler().sample(logits, all_params, gens, empty, empty)
    return torch.bincount(out.token_ids, minlength=NUM_VOCAB)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.8, top_p=0.8, min_p=0.05),
    ],
    ids=["temp0.7", "top_p0.9", "min_p0.1", "combined"],
)
def test_sampled_frequencies_match_reference(params):
    expected = _reference_probs(_row_logits(), params)
    counts = _sample_counts(params)
    assert chi_square_p_value(counts, expected) > 0.001
    # the check has power: the unfiltered temperature-1 distribution is rejected
    plain = _row_logits().softmax(-1)
    assert chi_square_p_value(counts, plain) < 1e-6


def test_sample_from_probs_handles_unnormalised_weights_and_zeros():
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])
    rows = weights.expand(NUM_SAMPLES, 6)
    gens = [stream(s, Purpose.DRAFT, 1) for s in range(NUM_SAMPLES)]
    counts = torch.bincount(sample_from_probs(rows, gens), minlength=6)
    assert counts[0] == counts[2] == counts[5] == 0
    assert chi_square_p_value(counts, weights / weights.sum()) > 0.001
