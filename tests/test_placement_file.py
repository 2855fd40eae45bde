"""Placement files: compact ranges, TOML round trip, validation that names what is missing."""

from __future__ import annotations

import tomllib

import pytest

from moemesh.common.placement.placement_file import (
    Placement,
    PlacementError,
    WorkerPlacement,
    format_ranges,
    format_toml,
    parse_ranges,
    parse_toml,
    placement_problems,
    read_placement,
    validate_for_config,
    validate_placement,
    write_placement,
)
from moemesh.common.model.presets import preset_config


def two_worker_placement(num_layers: int = 3, num_experts: int = 8) -> Placement:
    gpu = [(layer, expert) for layer in range(num_layers) for expert in range(num_experts) if expert % 3 == 0]
    cpu = [(layer, expert) for layer in range(num_layers) for expert in range(num_experts) if expert % 3]
    gpu_replicas = [(1, 1), (1, 2), (2, 7)]
    return Placement(num_layers, num_experts, 1000, (
        WorkerPlacement("expert-cuda0", "cuda:0", tuple(gpu), tuple(gpu_replicas), 0.75),
        WorkerPlacement("expert-cpu", "cpu", tuple(cpu), (), 0.25),
    ), policy="hottest", stats_source="run \"a\".csv")


def test_ranges_round_trip():
    assert format_ranges([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"
    assert format_ranges([]) == ""
    assert parse_ranges("0-2,5,7-8", "x") == [0, 1, 2, 5, 7, 8]
    assert parse_ranges("", "x") == []
    with pytest.raises(PlacementError, match="twice"):
        parse_ranges("0-3,2", "x")
    with pytest.raises(PlacementError, match="empty or negative"):
        parse_ranges("5-3", "x")
    with pytest.raises(PlacementError, match="not N or N-M"):
        parse_ranges("a-b", "x")


def test_toml_round_trip(tmp_path):
    placement = two_worker_placement()
    path = tmp_path / "placement.toml"
    write_placement(path, placement)
    assert read_placement(path) == placement
    data = tomllib.loads(path.read_text())
    assert [w["device"] for w in data["workers"]] == ["cuda:0", "cpu"]
    assert data["workers"][0]["experts"]["0"] == "0,3,6"
    assert data["workers"][0]["replicas"] == {"1": "1-2", "2": "7"}
    assert placement.holders()[(1, 1)] == ["expert-cpu", "expert-cuda0"]  # primary first
    assert placement.worker_bytes("expert-cuda0") == (9 + 3) * 1000


def test_valid_placement_has_no_problems():
    assert placement_problems(two_worker_placement(), 3, 8, 1000) == []
    validate_placement(two_worker_placement(), 3, 8)


def test_missing_experts_are_named():
    full = two_worker_placement()
    cpu = full.workers[1]
    dropped = tuple(i for i in cpu.expert_ids if i not in {(0, 4), (0, 5), (2, 1)})
    placement = Placement(3, 8, 1000, (full.workers[0], WorkerPlacement(cpu.name, cpu.device, dropped)))
    with pytest.raises(PlacementError) as error:
        validate_placement(placement, 3, 8)
    assert "3 (layer, expert) pairs are held by no worker: layer 0: 4-5; layer 2: 1" in str(error.value)


def test_every_kind_of_problem_is_reported():
    placement = Placement(2, 4, 1000, (
        WorkerPlacement("a", "cuda:0", ((0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 9)), ((0, 1),)),
        WorkerPlacement("a", "cpu", ((0, 0), (1, 1)), ((1, 2),)),
    ))
    problems = "\n".join(placement_problems(placement, 2, 4, 2000))
    assert "bytes_per_expert=1000, the model's experts take 2000" in problems
    assert "worker name 'a' is used twice" in problems
    assert "(layer 1, expert 9) is outside the model" in problems
    assert "(layer 0, expert 1) is both primary and replica" in problems
    assert "(layer 0, expert 0) is primary on both a and a" in problems
    assert "replicas without a primary copy: layer 1: 2" in problems
    assert "held by no worker: layer 1: 3" in problems
    shape = placement_problems(placement, 3, 4)
    assert any("the model has 3 x 4" in p for p in shape)


def test_validate_against_model_config():
    config = preset_config("v4-flash")
    layers, experts = config.num_hidden_layers, config.n_routed_experts
    ids = tuple((layer, expert) for layer in range(layers) for expert in range(experts))
    good = Placement(layers, experts, 13_369_344, (WorkerPlacement("expert-cuda0", "cuda:0", ids),))
    validate_for_config(good, config)
    bad = Placement(layers, experts, 13_369_344, (WorkerPlacement("expert-cuda0", "cuda:0", ids[1:]),))
    with pytest.raises(PlacementError, match="layer 0: 0"):
        validate_for_config(bad, config)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("format_version = 2\n", "format_version=2"),
        ("format_version = 1\nnum_layers = 2\nnum_experts = 4\n", "missing key bytes_per_expert"),
        ("format_version = 1\nnum_layers = 0\nnum_experts = 4\nbytes_per_expert = 1\n", "num_layers=0"),
        ("format_version = 1\nnum_layers = 1\nnum_experts = 4\nbytes_per_expert = 1\n[[workers]]\nname = 'a'\n",
         "needs string keys name and device"),
        ("format_version = 1\nnum_layers = 1\nnum_experts = 4\nbytes_per_expert = 1\n[[workers]]\nname = 'a'\n"
         "device = 'cpu'\n[workers.experts]\nx = '0'\n", "'x'"),
        ("format_version = [\n", "not valid TOML"),
    ],
)
def test_malformed_files_are_refused(text, message):
    with pytest.raises(PlacementError, match=message):
        parse_toml(text, "p.toml")


def test_written_toml_is_stable_text():
    text = format_toml(two_worker_placement())
    assert text == format_toml(parse_toml(text))
    assert 'stats = "run \\"a\\".csv"' in text
