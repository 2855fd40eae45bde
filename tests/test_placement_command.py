"""`moemesh placement plan|show` end to end on the V4-Flash preset (no weights, no torch)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from moemesh.cli import main
from moemesh.common.placement.placement_file import read_placement
from moemesh.common.placement.stats import Phase, RoutingStats, write_stats_files


def flash_stats(path) -> None:
    rng = random.Random(0)
    stats = RoutingStats(43, 256, 6)
    for layer in range(43):
        stats.add_counts(Phase.DECODE, layer, [int(50 * rng.paretovariate(1.2)) for _ in range(256)])
    write_stats_files(path, stats)


def test_plan_writes_a_valid_placement_and_prints_the_table(tmp_path, capsys):
    flash_stats(tmp_path / "stats.csv")
    out = tmp_path / "placement.toml"
    rc = main(["placement", "plan", "--preset", "v4-flash", "--stats", str(tmp_path / "stats.decode.csv"),
               "--budget", "cuda:0=80GiB", "--budget", "cpu=100GiB", "--throughput", "cuda:0=4000GB/s",
               "--throughput", "cpu=100GB/s", "--policy", "hottest", "--replicate-hot", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "cuda:0" in printed and "expert-cpu" in printed and "token share" in printed and "layer time" in printed
    placement = read_placement(out)
    assert placement.bytes_per_expert == 13_369_344 and placement.policy == "hottest"
    assert len(placement.worker("expert-cuda0").expert_ids) == 80 * 2**30 // 13_369_344
    rc = main(["placement", "show", str(out), "--preset", "v4-flash"])
    shown = capsys.readouterr().out
    assert rc == 0 and "valid (checked against the model config)" in shown and "expert-cuda0" in shown


def test_plan_refuses_an_infeasible_budget(tmp_path, capsys):
    rc = main(["placement", "plan", "--preset", "v4-flash", "--budget", "cuda:0=80GiB", "--budget", "cpu=50GiB",
               "--out", str(tmp_path / "p.toml")])
    error = capsys.readouterr().err
    assert rc == 1 and "short by 568 experts" in error and "cpu 50.00 GiB" in error
    assert not (tmp_path / "p.toml").exists()


def test_plan_rejects_stats_of_another_model(tmp_path, capsys):
    (tmp_path / "s.csv").write_text("1,2,3\n4,5,6\n")
    rc = main(["placement", "plan", "--preset", "v4-flash", "--stats", str(tmp_path / "s.csv"),
               "--budget", "cpu=200GiB", "--out", str(tmp_path / "p.toml")])
    assert rc == 1 and "2 layers x 3 experts" in capsys.readouterr().err


def test_show_reports_an_invalid_file(tmp_path, capsys):
    (tmp_path / "p.toml").write_text(
        'format_version = 1\nnum_layers = 2\nnum_experts = 4\nbytes_per_expert = 10\n'
        '[[workers]]\nname = "expert-cpu"\ndevice = "cpu"\n[workers.experts]\n0 = "0-3"\n1 = "0-1"\n')
    rc = main(["placement", "show", str(tmp_path / "p.toml")])
    printed = capsys.readouterr().out
    assert rc == 1 and "INVALID" in printed and "layer 1: 2-3" in printed


def test_plan_json_and_no_torch_import(tmp_path):
    # Only this command's module is imported, so another command importing torch cannot fail this test.
    code = (
        "import argparse, sys; from moemesh.commands import placement; "
        "parser = argparse.ArgumentParser(); placement.add_arguments(parser, 'placement'); "
        "args = parser.parse_args(['plan', '--preset', 'v4-flash', '--budget', 'cuda:0=150GiB', "
        f"'--json', '--out', {str(tmp_path / 'p.toml')!r}]); "
        "assert placement.run(args) == 0; assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["devices"][0]["num_experts"] == 43 * 256 and summary["devices"][0]["throughput_assumed"]
