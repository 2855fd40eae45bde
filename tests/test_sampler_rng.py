"""Per-request streams: reproducible, keyed by (seed, purpose, position), independent."""

import torch

from moemesh.common.sampling.rng import Purpose, derive_key, stream, streams_for_rows, uniform
from chi_square_support import chi_square_p_value


def test_same_key_gives_same_draws_and_fresh_generators():
    a = torch.rand(16, generator=stream(7, Purpose.SAMPLE, 3))
    b = torch.rand(16, generator=stream(7, Purpose.SAMPLE, 3))
    assert torch.equal(a, b)


def test_every_component_of_the_key_matters():
    base = derive_key(7, Purpose.SAMPLE, 3)
    assert derive_key(8, Purpose.SAMPLE, 3) != base
    assert derive_key(7, Purpose.DRAFT, 3) != base
    assert derive_key(7, Purpose.SAMPLE, 4) != base
    keys = {derive_key(7, purpose, 3) for purpose in Purpose}
    assert len(keys) == len(Purpose)


def test_draft_and_verify_streams_draw_different_noise():
    draft = torch.rand(64, generator=stream(11, Purpose.DRAFT, 5))
    for purpose in (Purpose.VERIFY_ACCEPT, Purpose.VERIFY_RESAMPLE, Purpose.SAMPLE):
        other = torch.rand(64, generator=stream(11, purpose, 5))
        assert not torch.equal(draft, other)


def test_draft_and_accept_uniforms_are_uncorrelated_across_seeds():
    num_seeds = 4000
    draft = torch.tensor([uniform(s, Purpose.DRAFT, 2) for s in range(num_seeds)])
    accept = torch.tensor([uniform(s, Purpose.VERIFY_ACCEPT, 2) for s in range(num_seeds)])
    correlation = torch.corrcoef(torch.stack([draft, accept]))[0, 1]
    assert abs(float(correlation)) < 4.0 / num_seeds**0.5  # ~4 sigma under independence
    # joint cells of a 4x4 grid are uniform, i.e. no dependence of any shape is visible
    cells = (draft * 4).long() * 4 + (accept * 4).long()
    counts = torch.bincount(cells, minlength=16)
    assert chi_square_p_value(counts, torch.full((16,), 1 / 16)) > 0.001


def test_uniform_is_in_unit_interval_and_uniform():
    values = torch.tensor([uniform(3, Purpose.VERIFY_ACCEPT, p) for p in range(5000)])
    assert float(values.min()) >= 0.0 and float(values.max()) < 1.0
    counts = torch.bincount((values * 10).long(), minlength=10)
    assert chi_square_p_value(counts, torch.full((10,), 0.1)) > 0.001


def test_seed_is_taken_modulo_2_64_and_position_must_be_non_negative():
    assert derive_key(-1, Purpose.SAMPLE, 0) == derive_key(2**64 - 1, Purpose.SAMPLE, 0)
    try:
        derive_key(1, Purpose.SAMPLE, -1)
    except ValueError:
        pass
    else:
        raise AssertionError("negative position accepted")


def test_streams_for_rows_skips_rows_without_seed():
    generators = streams_for_rows([None, 5], Purpose.SAMPLE, [0, 2])
    assert generators[0] is None
    expected = torch.rand(4, generator=stream(5, Purpose.SAMPLE, 2))
    assert torch.equal(torch.rand(4, generator=generators[1]), expected)


def test_key_exponentials_are_the_reference_draws_in_any_batch():
    from moemesh.common.sampling.rng import (derive_key, key_exponentials, key_exponentials_reference, signed_key)

    cases = [(0, 0), (7, 3), (2**63 + 5, 11), (123456789, 2**20)]
    keys = torch.tensor([signed_key(seed, Purpose.DRAFT, position) for seed, position in cases])
    batched = key_exponentials(keys, 16)  # [4, 16]
    for row, (seed, position) in enumerate(cases):
        want = torch.tensor(key_exponentials_reference(derive_key(seed, Purpose.DRAFT, position), 16))
        torch.testing.assert_close(batched[row], want, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(key_exponentials(keys[row: row + 1], 16)[0], batched[row], rtol=0.0, atol=0.0)
    assert (batched > 0).all() and torch.isfinite(batched).all()
    # Exp(1): mean ~1 over many draws, and different keys give different draws
    many = key_exponentials(torch.arange(64, dtype=torch.int64) * 7919, 512)
    assert abs(float(many.mean()) - 1.0) < 0.03
    assert not torch.equal(many[0], many[1])
