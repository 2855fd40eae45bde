"""Per-request feature rings (common/drafting/feature_ring.py): cap, rollback, isolation."""

from __future__ import annotations

import torch

from moemesh.common.drafting.feature_ring import FeatureRing, FeatureRings

D = 4


def rows(start: int, count: int) -> torch.Tensor:
    """Row i carries the value start + i in every column, so contents name their position."""
    return torch.arange(start, start + count, dtype=torch.float32)[:, None].expand(count, D).clone()


def assert_holds(ring: FeatureRing, first: int, last: int) -> None:
    features, positions = ring.context()
    assert positions.tolist() == list(range(first, last + 1))
    assert torch.equal(features, rows(first, last - first + 1))


def test_ring_keeps_the_last_128_positions_in_order():
    ring = FeatureRing(128, D, dtype=torch.float32)
    ring.append(0, rows(0, 100))
    ring.append(100, rows(100, 50))  # wraps
    assert ring.num_positions == 128 and ring.next_position == 150
    assert_holds(ring, 22, 149)
    for position in range(150, 300):  # one at a time, like decoding
        ring.append(position, rows(position, 1))
    assert_holds(ring, 172, 299)
    big = FeatureRing(128, D, dtype=torch.float32)
    big.append(0, rows(0, 1000))  # a long prefill: only the newest 128 survive
    assert_holds(big, 872, 999)


def test_truncate_rolls_back_to_the_accepted_length():
    ring = FeatureRing(8, D, dtype=torch.float32)
    ring.append(0, rows(0, 6))  # 6 positions, the last 3 of them drafts
    ring.truncate(4)  # one draft accepted: keep positions < 4
    assert_holds(ring, 0, 3)
    ring.append(4, rows(4, 2))
    assert_holds(ring, 0, 5)
    ring.truncate(0)
    assert ring.num_positions == 0 and ring.next_position is None
    ring.append(0, rows(0, 1))
    assert_holds(ring, 0, 0)


def test_appending_at_an_earlier_position_replaces_the_stale_tail_even_after_wrapping():
    ring = FeatureRing(8, D, dtype=torch.float32)
    ring.append(0, rows(0, 12))  # holds 4..11
    ring.append(9, rows(109, 2) - 100 + 0.5)  # resend 9, 10 with new values; 11 is gone
    features, positions = ring.context()
    assert positions.tolist() == [4, 5, 6, 7, 8, 9, 10]
    assert features[-2:, 0].tolist() == [9.5, 10.5] and features[0, 0] == 4


def test_requests_are_isolated_and_dropped():
    rings = FeatureRings(16, D, dtype=torch.float32)
    rings.append("a", 0, rows(0, 5))
    rings.append("b", 0, rows(50, 3))
    rings.truncate("a", 2)
    assert rings.ring("a").context()[1].tolist() == [0, 1]
    assert rings.ring("b").context()[0][:, 0].tolist() == [50, 51, 52]
    rings.drop("a")
    rings.drop("missing")  # ignored
    rings.truncate("missing", 3)  # ignored, creates nothing
    assert list(rings) == ["b"] and "a" not in rings and len(rings) == 1
    assert rings.ring("a").num_positions == 0  # a new request starts empty


def test_random_appends_and_truncates_match_a_list_of_the_newest_positions():
    """Against the plain model of a ring: the committed (position, feature) pairs, newest `max_positions`."""
    generator = torch.Generator().manual_seed(3)
    ring = FeatureRing(8, 2, dtype=torch.float32)
    kept: list[tuple[int, float]] = []
    next_position = 0
    for _ in range(300):
        if torch.rand(1, generator=generator).item() < 0.2 and kept:
            cut = int(torch.randint(0, next_position + 1, (1,), generator=generator))
            ring.truncate(cut)
            kept = [(p, v) for p, v in kept if p < cut]
            next_position = min(next_position, cut)
            continue
        start = int(torch.randint(max(0, next_position - 3), next_position + 3, (1,), generator=generator))
        count = int(torch.randint(1, 12, (1,), generator=generator))
        values = torch.randn(count, generator=generator)
        ring.append(start, values[:, None].expand(count, 2))
        kept = [(p, v) for p, v in kept if p < start] + [(start + i, float(values[i])) for i in range(count)]
        kept = kept[-8:]
        next_position = start + count
        features, positions = ring.context()
        assert positions.tolist() == [p for p, _ in kept]
        torch.testing.assert_close(features[:, 0], torch.tensor([v for _, v in kept]))


def test_rows_appended_before_verification_read_as_the_committed_prefix():
    """A verify step's rows go to the in-process drafter's ring before verification decides; after the
    truncation to the seed position that precedes every draft, the ring reads as if only the committed rows
    had been appended (here: a chunk of seed + 5 drafts at positions 40..45, 2 drafts accepted, so the new
    seed sits at 43 and positions 43..45 were rejected)."""
    features = torch.randn(60, 4)
    provisional = FeatureRing(16, 4, dtype=torch.float32, spare_positions=5)  # room for a block of drafts
    committed = FeatureRing(16, 4, dtype=torch.float32)
    for ring in (provisional, committed):
        ring.append(0, features[:40])  # the prefill's rows (the newest 16 kept)
    provisional.append(40, features[40:46])  # every row of the chunk
    committed.append(40, features[40:43])  # the seed and the two accepted drafts
    provisional.truncate(43)
    committed.truncate(43)
    (x, p), (y, q) = provisional.context(), committed.context()
    assert p.tolist() == list(range(27, 43)) and torch.equal(p, q) and torch.equal(x, y)
    # without the spare entries the six rows would have pushed out positions 27..29, still in the window
    bare = FeatureRing(16, 4, dtype=torch.float32)
    bare.append(0, features[:40])
    bare.append(40, features[40:46])
    bare.truncate(43)
    assert bare.context()[1].tolist() == list(range(30, 43))
    # the next verify step's chunk starts at the new seed: the same again
    provisional.append(43, features[43:49])
    committed.append(43, features[43:45])
    provisional.truncate(45)
    assert all(torch.equal(a, b) for a, b in zip(provisional.context(), committed.context()))
