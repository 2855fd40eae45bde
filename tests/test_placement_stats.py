"""Routing statistics: Lucebox-format CSV read/write, phases, merge, skew measures."""

from __future__ import annotations

import math

import pytest

from moemesh.common.placement.stats import (
    Phase,
    RoutingStats,
    StatsError,
    layer_skew,
    parse_csv,
    phase_path,
    read_csv,
    read_stats_files,
    write_csv,
    write_stats_files,
)

# Written the way Lucebox's MoeHybridRoutingStats::save_csv writes a hotness table (no phase key).
LUCEBOX_FILE = """\
# hotness table: n_layer=3 n_expert=4 n_expert_used=2
# format: one row per layer, columns are expert activation counts (expert 0..N-1)
10,0,5,5
1,2,3,4
0,0,0,8
"""


def small_stats() -> RoutingStats:
    stats = RoutingStats(num_layers=3, num_experts=4, num_experts_per_tok=2)
    stats.add_counts(Phase.PREFILL, 0, [4, 0, 1, 1])
    stats.add_counts(Phase.DECODE, 0, [1, 2, 0, 0])
    stats.observe(Phase.DECODE, 2, [3, 3, 1])
    return stats


def test_reads_a_hand_written_lucebox_file():
    stats = parse_csv(LUCEBOX_FILE, "lucebox.csv")
    assert (stats.num_layers, stats.num_experts, stats.num_experts_per_tok) == (3, 4, 2)
    assert stats.counts() == [[10, 0, 5, 5], [1, 2, 3, 4], [0, 0, 0, 8]]
    assert stats.has_phase(Phase.UNSPLIT) and not stats.has_phase(Phase.DECODE)  # no phase key: unsplit
    assert stats.shares()[2] == [0.0, 0.0, 0.0, 1.0]


def test_reads_lucebox_file_without_header_keys_and_with_loose_spacing():
    text = "# hotness table\n# format: rows\n 1, 2 ,3\n\n4,5,6,\n"
    stats = parse_csv(text)
    assert stats.counts() == [[1, 2, 3], [4, 5, 6]] and stats.num_experts_per_tok is None


def test_written_file_is_lucebox_layout(tmp_path):
    path = tmp_path / "stats.csv"
    write_csv(path, small_stats(), Phase.UNSPLIT)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# hotness table: n_layer=3 n_expert=4 n_expert_used=2")
    assert lines[1].startswith("# format:")
    assert lines[2:] == ["5,2,1,1", "0,0,0,0", "0,1,0,2"]  # all phases summed, one row per layer
    # Lucebox parses the first header line with a fixed sscanf prefix; our extra key must come after it.
    assert lines[0].split(" phase=")[0] == "# hotness table: n_layer=3 n_expert=4 n_expert_used=2"


def test_round_trip_keeps_the_phase_split(tmp_path):
    stats = small_stats()
    written = write_stats_files(tmp_path / "run.csv", stats)
    assert written == [tmp_path / "run.csv", tmp_path / "run.prefill.csv", tmp_path / "run.decode.csv"]
    prefill, decode = read_csv(written[1]), read_csv(written[2])
    assert prefill.counts([Phase.PREFILL]) == stats.counts([Phase.PREFILL])
    assert decode.counts([Phase.DECODE]) == stats.counts([Phase.DECODE])
    both = read_stats_files(written[1:])
    for phase in (Phase.PREFILL, Phase.DECODE):
        assert both.counts([phase]) == stats.counts([phase])
    total = read_csv(written[0])
    assert total.counts() == stats.counts() and total.counts([Phase.UNSPLIT]) == stats.counts()


def test_phase_path_names_siblings(tmp_path):
    assert phase_path(tmp_path / "a.csv", Phase.DECODE) == tmp_path / "a.decode.csv"
    assert phase_path(tmp_path / "a", Phase.PREFILL) == tmp_path / "a.prefill.csv"
    assert phase_path(tmp_path / "a.csv", Phase.UNSPLIT) == tmp_path / "a.csv"


def test_merge_adds_counts_and_refuses_other_shapes():
    merged = small_stats().merge(parse_csv(LUCEBOX_FILE))
    assert merged.layer_counts(0) == [15, 2, 6, 6]
    assert merged.layer_counts(0, [Phase.DECODE]) == [1, 2, 0, 0]
    with pytest.raises(StatsError, match="cannot merge"):
        small_stats().merge(RoutingStats(3, 5))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# hotness table: n_layer=2 n_expert=3\n1,2,3\n", "n_layer=2 but the file has 1 rows"),
        ("1,2,3\n1,2\n", "2 counts, earlier rows have 3"),
        ("1,-2,3\n", "'-2' is not a non-negative integer"),
        ("1,x,3\n", "'x' is not"),
        ("# only comments\n", "no count rows"),
        ("# hotness table: n_layer=1 n_expert=2 phase=warmup\n1,2\n", "phase='warmup'"),
    ],
)
def test_bad_files_are_refused_with_the_line(text, message):
    with pytest.raises(StatsError, match=message):
        parse_csv(text, "bad.csv")


def test_counting_checks_ids_and_shapes():
    stats = RoutingStats(2, 4)
    with pytest.raises(StatsError, match="expert id 4"):
        stats.observe(Phase.DECODE, 0, [4])
    with pytest.raises(StatsError, match="layer 2"):
        stats.add_counts(Phase.DECODE, 2, [0, 0, 0, 0])
    with pytest.raises(StatsError, match="got 3 counts"):
        stats.add_counts(Phase.DECODE, 0, [0, 0, 0])


def test_skew_measures():
    uniform = layer_skew(0, [5] * 16)
    assert uniform.max_over_mean == pytest.approx(1.0)
    assert uniform.effective_experts == pytest.approx(16.0)
    assert uniform.top8_share == pytest.approx(0.5) and uniform.num_unused == 0
    one_hot = layer_skew(1, [0] * 15 + [30])
    assert one_hot.max_over_mean == pytest.approx(16.0)
    assert one_hot.effective_experts == pytest.approx(1.0)
    assert one_hot.top8_share == 1.0 and one_hot.num_unused == 15
    two = layer_skew(2, [1, 3])
    assert two.effective_experts == pytest.approx(math.exp(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))))
    empty = small_stats().skew(1)
    assert empty.num_activations == 0 and empty.effective_experts == 4.0
