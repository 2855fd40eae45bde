"""Speculation in bench.fullsize: the oracle draft source driving the router's scheduler in-process
(services/router/offline_engine.py, whose drafts are tested in tests/test_offline_engine.py), the
output comparison and the figures of a speculative run; end to end, `python -m moemesh.bench.fullsize
--tiny --speculation oracle,drafter` (attention worker in process, two expert worker processes, the
DSpark draft worker process, all loading a tiny random checkpoint with DSpark stages) whose speculative
greedy outputs must equal the in-process plain reference token for token, with every oracle draft
accepted.

The oracle test builds StepResults by hand: they stand for what the attention worker answers (the
worker's own verification is tested in tests/test_spec_*.py and, here, end to end).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import SequenceResult, StepResult
from moemesh.services.router.offline_engine import OfflineEngine
from moemesh.services.router.scheduler import SchedulerConfig

REPO = Path(__file__).resolve().parents[1]


def test_oracle_drafts_are_the_plain_continuation():
    from moemesh.bench.fullsize_spec import OracleDrafts

    answers = iter([((10,), 0), ((11, 12, 13, 14), 3), ((15, 16), 1)])  # (tokens, drafts accepted) per step

    def worker(plan):
        if not plan.sequences:  # the last plan only releases the finished request's slot
            return StepResult(step_id=plan.step_id, sequences=())
        tokens, accepted = next(answers)
        (seq,) = plan.sequences
        return StepResult(step_id=plan.step_id, sequences=(SequenceResult(seq.request_id, tokens, num_draft_accepted=accepted),))

    engine = OfflineEngine(SchedulerConfig(num_gpu_blocks=4, max_model_len=512), worker)
    output = engine.add_request("o-0", [5, 6], SamplingParams(max_tokens=7, ignore_eos=True))
    oracle = OracleDrafts([[10, 11, 12, 13, 14, 15, 16]], "o", width=3)
    oracle.propose(engine)  # nothing: still waiting, not caught up
    assert engine.step().num_drafts == 0
    oracle.propose(engine)
    record = engine.step()
    assert record.num_drafts == 3 and record.num_accepted == 3
    oracle.propose(engine)
    assert engine.requests["o-0"].draft_token_ids == [15]  # 5 of max_tokens 7 generated: one draft at most
    engine.run()
    assert output.output_token_ids == [10, 11, 12, 13, 14, 15, 16] and oracle.num_short == 0


def test_compare_outputs_finds_the_first_mismatch():
    from moemesh.bench.fullsize_spec import compare_outputs

    plain = {"p-0": [1, 2, 3, 4], "p-1": [5, 6, 7]}
    same = compare_outputs(plain, {"s-0": [1, 2, 3], "s-1": [5, 6, 7]}, "p", "s")
    assert same["outputs_equal_plain"] and same["num_tokens_compared"] == 6
    wrong = compare_outputs(plain, {"s-0": [1, 2, 3, 4], "s-1": [5, 9, 7]}, "p", "s")
    assert not wrong["outputs_equal_plain"]
    assert wrong["first_mismatch"] == {"request": 1, "position": 1, "spec": 9, "plain": 6}


def test_spec_row_figures_from_step_timings():
    from moemesh.bench.fullsize_spec import DraftSource, spec_row
    from moemesh.bench.fullsize_timing import RunResult, TimedStep

    def step(step_id, is_decode, began_s, ended_s, num_drafts=0, num_accepted=0, num_tokens_gained=0, draft_s=0.0):
        return TimedStep(step_id, 8, 2, is_decode, began_s, ended_s, num_drafts, num_accepted, num_tokens_gained, (),
                         draft_s=draft_s)

    result = RunResult(steps=[
        step(1, False, 0.0, 1.0),  # prefill: not counted
        step(2, True, 1.0, 1.2, num_drafts=6, num_accepted=0, num_tokens_gained=2, draft_s=0.1),  # warm-up
        step(3, True, 2.0, 2.2, num_drafts=6, num_accepted=2, num_tokens_gained=4, draft_s=0.05),
        step(4, True, 3.0, 3.4, num_drafts=6, num_accepted=4, num_tokens_gained=6, draft_s=0.05),
    ])
    row = spec_row(DraftSource.DRAFTER, 3, result, 1, plain_step_s=0.1, plain_tokens_per_s=20.0, batch=2)
    assert row["num_verify_steps"] == 2 and row["num_tokens_gained"] == 10
    assert row["tau"] == pytest.approx(10 / 4)  # tokens per sequence per verify step
    assert row["tokens_per_s"] == pytest.approx(10 / (0.2 + 0.05 + 0.4 + 0.05))
    assert row["acceptance_rate"] == pytest.approx(6 / 12)
    assert row["verify_step_s"] == pytest.approx(0.3) and row["verify_over_plain_step"] == pytest.approx(3.0)
    assert row["draft_round_trip_s"] == pytest.approx(0.05)
    assert row["speedup_over_plain"] == pytest.approx(row["tokens_per_s"] / 20.0)


def test_fullsize_tiny_speculation_equals_in_process(tmp_path):
    out_dir = tmp_path / "out"
    width = 2
    command = [sys.executable, "-m", "moemesh.bench.fullsize", "--tiny", "--layers", "4", "--batch", "2",
               "--routing", "uniform", "--decode-steps", "2", "--warmup-steps", "1", "--context", "5",
               "--speculation", "oracle,drafter", "--spec-width", str(width), "--out-dir", str(out_dir),
               "--run-dir", str(tmp_path / "run"), "--checkpoint-cache", str(tmp_path / "checkpoints")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = out_dir.glob("fullsize-*-2*.json")
    raw = json.loads(path.read_text())["raw"]
    assert raw["reference_check"]["ok"]  # the plain split run equals the in-process run
    assert raw["spec_reference_check"]["ok"], raw["spec_reference_check"]
    rows = {row["source"]: row for row in raw["speculative"]}
    assert set(rows) == {"oracle", "drafter"}
    oracle, drafter = rows["oracle"], rows["drafter"]
    num_plain_tokens = 1 + (1 + 2) * (width + 1)
    for row in (oracle, drafter):
        assert row["outputs_equal_plain"] and row["num_tokens_compared"] == 2 * num_plain_tokens
        assert row["reference_check"]["tokens_equal"] and row["reference_check"]["complete"]
        assert row["verify_step_s"] > 0 and row["plain_step_s"] > 0 and row["tokens_per_s"] > 0
    # every oracle draft accepted: width + 1 tokens per sequence and verify step
    assert oracle["oracle_all_accepted"] and oracle["acceptance_rate"] == 1.0
    assert oracle["tau"] == pytest.approx(width + 1) and oracle["num_verify_steps"] == 2
    # the draft worker proposed full blocks every step and was timed; tau is what verification gave
    assert drafter["drafter_num_proposed"] > 0 and drafter["draft_round_trip_s"] > 0
    assert drafter["num_drafts"] > 0 and 1.0 <= drafter["tau"] <= width + 1
    assert raw["draft_worker"]["width"] == width


def test_logprob_diagnosis_measures_noise_before_and_the_margin_at_the_mismatch():
    from moemesh.bench.fullsize_spec import logprob_diagnosis
    from moemesh.bench.fullsize_timing import RunResult

    plain = RunResult(outputs={"p-0": [1, 2, 3]}, logprobs={"p-0": [-0.5, -1.0, -0.2]},
                      top_logprobs={"p-0": [((1, 7), (-0.5, -2.0)), ((2, 9), (-1.0, -1.01)), ((3, 4), (-0.2, -3.0))]})
    spec = RunResult(outputs={"s-0": [1, 9, 5]}, logprobs={"s-0": [-0.5, -0.98, -0.1]},
                     top_logprobs={"s-0": [((1, 7), (-0.5, -2.0)), ((9, 2), (-0.98, -1.03)), ((5, 3), (-0.1, -2.5))]})
    diagnosis = logprob_diagnosis(plain, spec, "p", "s")
    assert diagnosis["num_positions_compared"] == 1 and diagnosis["abs_logprob_diff_max"] == 0.0
    (item,) = diagnosis["mismatches"]
    assert item["position"] == 1 and item["plain_margin"] == pytest.approx(0.01)
    assert item["spec_margin"] == pytest.approx(0.05) and item["plain_top"][0] == (2, -1.0)
