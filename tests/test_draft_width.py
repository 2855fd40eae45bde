"""Speculation width policy (services/draft/width.py): fixed, adaptive, defaults, and refusals at start."""

from __future__ import annotations

import pytest

from services.draft.width import SpeculationConfig, SpeculationError, SpeculationMode, choose_width, prefix_survival


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

    code = "import sys, services.draft.width, services.draft.main; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
