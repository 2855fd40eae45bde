"""The speculation benchmark's deterministic decode checks (bench/speculation_checks.py) and that
bench/speculation.py writes its JSON when it cannot finish (a server that does not start, SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moemesh.bench.speculation import _summarise
from moemesh.bench.speculation_checks import policy_chose_plain, run_problems, speedups
from spec_support import DEFAULT_MODEL, REPO_ROOT


def _run(**overrides) -> dict:
    run = {"finish_reasons": ["length", "stop"], "completion_tokens": [8, 5], "cached_tokens": 0,
           "tokens_per_s": 10.0, "decode_tokens_per_s": 12.0, "speculation_ran": True, "num_draft_requests": 4, "policy": {},
           "texts": ["a b c", "d e"], "output_hash": "h"}
    return {**run, **overrides}


def test_a_good_run_passes():
    assert run_problems("fixed/t0", _run(), max_tokens=8, speculative=True, ignore_eos=False) == []


@pytest.mark.parametrize("overrides, ignore_eos, expected", [
    ({"completion_tokens": [0, 5]}, False, "short request (0 tokens"),
    ({"completion_tokens": [7, 5]}, False, "short request (7 tokens, finish length)"),
    ({}, True, "short request (5 tokens, finish stop)"),  # with ignore_eos every request must reach max_tokens
    ({"finish_reasons": ["length", "abort"]}, False, "finish reasons"),
    ({"cached_tokens": 16}, False, "hit a cached prefix (16 tokens)"),
    ({"tokens_per_s": 0.0}, False, "zero throughput"),
    ({"speculation_ran": False}, False, "speculation did not run"),
])
def test_each_failure_condition_is_flagged(overrides, ignore_eos, expected):
    problems = run_problems("fixed/t0", _run(**overrides), max_tokens=8, speculative=True, ignore_eos=ignore_eos)
    assert any(expected in problem for problem in problems), problems


def test_a_policy_that_chose_plain_steps_is_not_a_silent_fallback():
    # no draft verified, but the router's cost-aware policy cut every proposal it asked for
    chose = _run(speculation_ran=False, policy={"num_cut_drafts": 12, "num_skipped_steps": 0})
    assert policy_chose_plain(chose)
    assert run_problems("adaptive/t0", chose, max_tokens=8, speculative=True, ignore_eos=False) == []
    skipped = _run(speculation_ran=False, num_draft_requests=0, policy={"num_skipped_steps": 30})
    assert policy_chose_plain(skipped)
    # the drafter never answered and the policy did nothing: still a failure
    silent = _run(speculation_ran=False, num_draft_requests=0, policy={"num_cut_drafts": 0})
    assert not policy_chose_plain(silent)
    assert run_problems("adaptive/t0", silent, max_tokens=8, speculative=True, ignore_eos=False)


def test_greedy_outputs_are_compared_repeat_by_repeat():
    runs = {
        # off's repeat 0 failed: its only run is repeat 1
        "off/temperature=0/streams=1": [{**_run(texts=["x y"]), "repeat": 1}],
        "fixed/temperature=0/streams=1": [{**_run(texts=["other nonce"]), "repeat": 0},
                                          {**_run(texts=["x y"], tokens_per_s=20.0, decode_tokens_per_s=36.0),
                                           "repeat": 1}],
        "off/temperature=1/streams=1": [{**_run(texts=["s"]), "repeat": 0}],
        "fixed/temperature=1/streams=1": [{**_run(texts=["t"]), "repeat": 0}],  # sampled: texts may differ
    }
    problems: list[str] = []
    ratios = speedups(_summarise(runs), problems)
    assert problems == []
    assert ratios["speedup/fixed/temperature=0/streams=1"] == pytest.approx(20.0 / 10.0)  # upper median of 10, 20
    # the decode alone: the median of each mode's repeats (12 and 36 -> 24) over off's (12)
    assert ratios["decode_speedup/fixed/temperature=0/streams=1"] == pytest.approx(24.0 / 12.0)
    runs["fixed/temperature=0/streams=1"][1]["texts"] = ["x z"]
    speedups(_summarise(runs), problems)
    assert len(problems) == 1 and "greedy output hash differs with speculation fixed" in problems[0]


def _bench(tmp_path, *args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "moemesh.bench.speculation", "--out-dir", str(tmp_path), "--max-tokens", "4",
                             "--streams", "1", "--temperatures", "0", *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _written(tmp_path) -> dict:
    paths = sorted(tmp_path.glob("speculation-*.json"))
    assert len(paths) == 1, list(tmp_path.iterdir())
    return json.loads(paths[0].read_text())


def test_a_server_that_does_not_start_still_gives_a_json(tmp_path):
    bench = _bench(tmp_path, "--modes", "off", "--model", str(tmp_path / "no-such-model"))
    output, _ = bench.communicate(timeout=120)
    assert bench.returncode == 1, output
    problems = _written(tmp_path)["raw"]["problems"]
    assert len(problems) == 1 and "serve (off) did not start" in problems[0], problems


@pytest.mark.skipif(not any(DEFAULT_MODEL.glob("*.safetensors")), reason="default model weights missing")
def test_sigterm_stops_the_servers_and_writes_the_runs_so_far(tmp_path):
    bench = _bench(tmp_path, "--modes", "off", "--model", str(DEFAULT_MODEL))
    time.sleep(3.0)  # the server is starting: stop it there
    bench.send_signal(signal.SIGTERM)
    output, _ = bench.communicate(timeout=60)
    assert bench.returncode == 1, output
    raw = _written(tmp_path)["raw"]
    assert any("stopped early (stopped by signal 15)" in problem for problem in raw["problems"]), raw["problems"]
    assert raw["runs"] == {}
