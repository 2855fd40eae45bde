"""Speculation width policy (common/speculation_width.py): fixed, adaptive, defaults, refusals at start, and
the cost-aware batch widths (expected committed tokens per second, docs/speculation.md §2.4)."""

from __future__ import annotations

import pytest

import random

from moemesh.common.speculation_width import (
    SpeculationConfig, SpeculationError, SpeculationMode, choose_width, cost_aware_widths, drafting_pays,
    expected_committed_tokens, prefix_survival, survival_curve,
)


def test_fixed_width_takes_that_many_drafts_whatever_the_confidences():
    config = SpeculationConfig(SpeculationMode.FIXED, width=3)
    assert choose_width([0.01, 0.01, 0.01, 0.01, 0.01], config) == 3
    assert choose_width([0.99] * 5, config) == 3
    assert choose_width([0.9, 0.9], config) == 2  # fewer slots available than the width


def test_adaptive_stops_where_prefix_survival_drops_below_threshold():
    config = SpeculationConfig(SpeculationMode.ADAPTIVE, width=5, survival_threshold=0.3)
    # survival 0.9, 0.72, 0.504, 0.252, 0.2495 -> at 0.3 stop after the third
    confidences = [0.9, 0.8, 0.7, 0.5, 0.99]
    assert prefix_survival(confidences)[:3] == pytest.approx([0.9, 0.72, 0.504])
    assert choose_width(confidences, config) == 3
    assert choose_width(confidences, SpeculationConfig(SpeculationMode.ADAPTIVE, width=5, survival_threshold=0.6)) == 2
    assert choose_width(confidences, SpeculationConfig(SpeculationMode.ADAPTIVE, width=5, survival_threshold=0.25)) == 4
    assert choose_width([0.99] * 5, SpeculationConfig(SpeculationMode.ADAPTIVE, width=4)) == 4  # capped by width
    # a later confident slot never revives a prefix that already dropped below
    assert choose_width([0.2, 1.0, 1.0], SpeculationConfig(SpeculationMode.ADAPTIVE, width=3, min_width=1)) == 1
    assert choose_width([0.2, 1.0, 1.0], SpeculationConfig(SpeculationMode.ADAPTIVE, width=3, min_width=2)) == 2


def test_off_drafts_nothing():
    config = SpeculationConfig(SpeculationMode.OFF)
    assert not config.enabled and choose_width([0.99] * 5, config) == 0


def test_width_larger_than_block_size_is_refused_at_start_with_a_clear_message():
    with pytest.raises(SpeculationError, match=r"--spec-width 7 exceeds the drafter's block size \(dspark_block_size = 5\)"):
        SpeculationConfig.for_model("fixed", 7, block_size=5)
    with pytest.raises(SpeculationError, match="dspark_block_size = 5"):
        SpeculationConfig.for_model("adaptive", 6, block_size=5)
    assert SpeculationConfig.for_model("fixed", 5, block_size=5).width == 5


def test_defaults_follow_the_checkpoint():
    assert SpeculationConfig.for_model(None, None, block_size=5) == SpeculationConfig(SpeculationMode.ADAPTIVE, 5)
    assert SpeculationConfig.for_model(None, None, block_size=None).mode is SpeculationMode.OFF
    assert SpeculationConfig.for_model("fixed", None, block_size=5).width == 5
    with pytest.raises(SpeculationError, match="no DSpark drafter"):
        SpeculationConfig.for_model("adaptive", None, block_size=None)
    with pytest.raises(SpeculationError, match="no DSpark drafter"):
        SpeculationConfig.for_model("fixed", 2, block_size=None)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"mode": SpeculationMode.OFF, "width": 3}, "with --speculation off"),
    ({"mode": SpeculationMode.FIXED, "width": 0}, "needs a width >= 1"),
    ({"mode": SpeculationMode.FIXED, "width": None}, "needs a width >= 1"),
    ({"mode": SpeculationMode.ADAPTIVE, "width": 3, "survival_threshold": 1.5}, r"must be in \(0, 1\)"),
    ({"mode": SpeculationMode.ADAPTIVE, "width": 3, "min_width": 4}, "min width 4"),
    ({"mode": "sometimes", "width": 3}, "choose one of off, fixed, adaptive"),
])
def test_inconsistent_configs_are_refused(kwargs, pattern):
    with pytest.raises(SpeculationError, match=pattern):
        SpeculationConfig(**kwargs)


def test_unknown_mode_string_is_refused():
    with pytest.raises(SpeculationError, match="--speculation 'always'"):
        SpeculationConfig.for_model("always", None, block_size=5)


def test_width_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, moemesh.common.speculation_width, moemesh.services.draft.main; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# -- cost-aware widths ------------------------------------------------------------------------------


def test_expected_throughput_objective_on_a_hand_worked_example():
    # request A: confidences 0.9, 5/9 -> survivals 0.9, 0.5; request B: 0.6. Cycle 10 ms + 2.5 ms per draft.
    survivals = [survival_curve([0.9, 5 / 9]), survival_curve([0.6])]
    assert survivals[0] == pytest.approx([0.9, 0.5])
    cycle_ms = lambda num_drafts: 10.0 + 2.5 * num_drafts  # noqa: E731
    # candidates by survival: A1 0.9, B1 0.6, A2 0.5. Committed tokens / cycle for K = 0..3:
    # 2 / 10 = 0.2; 2.9 / 12.5 = 0.232; 3.5 / 15 = 0.2333; 4.0 / 17.5 = 0.2286 -> K = 2: A verifies 1, B 1
    choice = cost_aware_widths(survivals, cycle_ms)
    assert choice.widths == (1, 1)
    assert choice.expected_tokens == pytest.approx(3.5) and choice.cycle_s == pytest.approx(15.0)
    assert choice.tokens_per_s == pytest.approx(3.5 / 15.0)
    assert expected_committed_tokens(survivals, (1, 1)) == pytest.approx(3.5)
    assert expected_committed_tokens(survivals, (2, 0)) == pytest.approx(1 + 0.9 + 0.5 + 1)
    assert expected_committed_tokens(survivals, (0, 0)) == 2.0
    # a steeper step: 2 / 10 = 0.2 beats 2.9 / 14 = 0.207? no: 0.207 > 0.2 -> K = 1 at 4 ms per draft
    assert cost_aware_widths(survivals, lambda k: 10.0 + 4.0 * k).widths == (1, 0)
    # steeper still: 2.9 / 15 = 0.193 < 0.2 -> verify nothing
    assert cost_aware_widths(survivals, lambda k: 10.0 + 5.0 * k).widths == (0, 0)
    with pytest.raises(ValueError, match="width 3 outside"):
        expected_committed_tokens(survivals, (3, 0))


def _random_blocks(seed: int, num_requests: int, block_size: int = 5) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.uniform(0.05, 0.99) for _ in range(block_size)] for _ in range(num_requests)]


@pytest.mark.parametrize("seed", range(5))
def test_free_verification_equals_the_confidence_only_rule(seed):
    config = SpeculationConfig(SpeculationMode.ADAPTIVE, width=5, survival_threshold=0.3)
    blocks = _random_blocks(seed, num_requests=8)
    caps = [choose_width(block, config) for block in blocks]
    survivals = [survival_curve(block[:cap]) for block, cap in zip(blocks, caps)]
    assert cost_aware_widths(survivals, lambda num_drafts: 0.05).widths == tuple(caps)


@pytest.mark.parametrize("seed", range(3))
def test_widths_shrink_as_the_marginal_step_cost_per_token_grows(seed):
    blocks = [survival_curve(block) for block in _random_blocks(seed, num_requests=8)]
    previous = None
    totals = []
    for per_token_ms in [0.0, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0]:
        choice = cost_aware_widths(blocks, lambda k, slope=per_token_ms: 20.0 + 5.0 + slope * k)
        assert all(0 <= width <= len(block) for width, block in zip(choice.widths, blocks))
        if previous is not None:
            assert all(now <= before for now, before in zip(choice.widths, previous))
        previous = choice.widths
        totals.append(choice.num_draft_tokens)
    assert totals[0] == 8 * 5 and totals[-1] == 0 and len(set(totals)) > 2, totals


def test_the_best_choice_beats_every_other_width_vector_on_a_small_batch():
    import itertools

    survivals = [survival_curve([0.95, 0.8, 0.5]), survival_curve([0.7, 0.9]), survival_curve([0.3])]
    cycle = lambda k: 30.0 + 3.0 * k  # noqa: E731
    choice = cost_aware_widths(survivals, cycle)
    for widths in itertools.product(*(range(len(s) + 1) for s in survivals)):
        rate = expected_committed_tokens(survivals, widths) / cycle(sum(widths))
        assert rate <= choice.tokens_per_s + 1e-12, widths


def test_survival_curve_is_clipped_and_non_increasing():
    assert survival_curve([1.5, 0.5, float("nan"), 0.9]) == [1.0, 0.5, 0.0, 0.0]
    assert survival_curve([]) == []


def test_drafting_pays_compares_with_a_plain_step():
    survivals = [[0.9, 0.8]] * 2
    # drafted cycle 10 ms + 2 ms per draft (drafter included) vs plain 8 ms: K = 4 -> 5.4 / 18 = 0.3 > 2 / 8
    assert drafting_pays(survivals, lambda k: 10.0 + 2.0 * k, plain_cycle_s=8.0)
    # a slow drafter: 2.9 / 42 at best, plain 0.25 per ms
    assert not drafting_pays(survivals, lambda k: 40.0 + 2.0 * k, plain_cycle_s=8.0)
    assert not drafting_pays([[], []], lambda k: 1.0, plain_cycle_s=8.0)  # nothing to verify
    with pytest.raises(ValueError, match="must be a finite time > 0"):
        cost_aware_widths(survivals, lambda k: 0.0)
