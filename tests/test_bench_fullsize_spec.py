"""Speculation in bench.fullsize: the LocalPlanner's drafts (budget, blocks, accepted + bonus, rejected
drafts' blocks freed), the oracle draft source, the output comparison and the figures of a
speculative run; end to end, `python -m moemesh.bench.fullsize --tiny --speculation oracle,drafter` (attention
worker in process, two expert worker processes, the DSpark draft worker process, all loading a tiny
random checkpoint with DSpark stages) whose speculative greedy outputs must equal the in-process plain reference token for token,
with every oracle draft accepted.

The planner tests build StepResults by hand: they stand for what the attention worker answers (the
worker's own verification is tested in tests/test_spec_*.py and, here, end to end).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import SequenceResult, StepResult, TokenLogprobs
from moemesh.services.attention.local_plan import LocalPlanConfig, LocalPlanner, LocalRequest, PlanError

REPO = Path(__file__).resolve().parents[1]


def _planner(prompts, max_tokens=8, block_size=4, num_blocks=16, budget=64, chunk=64, temperature=0.0, prefix="r"):
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                            seed=1 if temperature else None)
    requests = [LocalRequest(f"{prefix}{i}", list(p), params) for i, p in enumerate(prompts)]
    config = LocalPlanConfig(block_size_tokens=block_size, num_primary_blocks=num_blocks, max_num_batched_tokens=budget,
                             max_chunk_tokens=chunk)
    return LocalPlanner(config, requests), requests


def _answer(plan, tokens_by_id, accepted_by_id=None, logprobs=False):
    accepted_by_id = accepted_by_id or {}
    sequences = []
    for seq in plan.sequences:
        tokens = tuple(tokens_by_id.get(seq.request_id, ())) if seq.do_sample else ()
        lp = TokenLogprobs(logprobs=tuple(-float(i + 1) for i in range(len(tokens)))) if logprobs and tokens else None
        sequences.append(SequenceResult(seq.request_id, tokens, num_draft_accepted=accepted_by_id.get(seq.request_id, 0),
                                        logprobs=lp))
    return StepResult(step_id=plan.step_id, sequences=tuple(sequences))


def test_drafts_ride_along_once_caught_up_and_count_in_budget_and_blocks():
    planner, (request,) = _planner([[5, 6, 7]], block_size=4)
    planner.set_drafts("r0", [1, 2, 3])  # given during the prefill: not used until caught up
    plan = planner.next_plan()
    (seq,) = plan.sequences
    assert seq.token_ids == (5, 6, 7) and seq.draft_token_ids == () and seq.do_sample
    planner.update(_answer(plan, {"r0": [40]}))
    assert request.draft_token_ids == [1, 2, 3]  # not scheduled with drafts yet: kept
    plan = planner.next_plan()
    (seq,) = plan.sequences
    # seed 40 at position 3, then the three drafts at 4..6: 7 tokens -> 2 blocks of 4
    assert seq.token_ids == (40, 1, 2, 3) and seq.draft_token_ids == (1, 2, 3) and seq.start_position == 3
    assert len(seq.block_ids[0]) == 2 and seq.do_sample
    # two drafts accepted, then the bonus: tokens gained 1, 2, 77
    planner.update(_answer(plan, {"r0": [1, 2, 77]}, {"r0": 2}))
    assert request.output_token_ids == [40, 1, 2, 77]
    assert request.num_computed == 6  # prompt 3 + seed + 2 accepted; the rejected draft (position 6) uncounted
    assert request.draft_token_ids == [] and request.num_draft_accepted == 2 and request.num_draft_tokens == 3
    assert len(request.primary_blocks) == 2  # positions 0..5 still need both blocks
    # all drafts rejected: the block that only held drafts goes back to the free list
    planner.set_drafts("r0", [9, 9, 9])
    plan = planner.next_plan()
    (seq,) = plan.sequences
    assert seq.start_position == 6 and seq.token_ids == (77, 9, 9, 9) and len(seq.block_ids[0]) == 3
    num_free = len(planner.free_primary)
    planner.update(_answer(plan, {"r0": [8]}, {"r0": 0}))
    assert request.num_computed == 7 and len(request.primary_blocks) == 2
    assert len(planner.free_primary) == num_free + 1


def test_drafts_never_pass_max_tokens_the_budget_or_the_chunk_cap():
    planner, requests = _planner([[5], [6]], max_tokens=3, budget=3)
    plan = planner.next_plan()
    planner.update(_answer(plan, {"r0": [10], "r1": [20]}))
    planner.set_drafts("r0", [1, 2, 3, 4])
    planner.set_drafts("r1", [1, 2, 3, 4])
    plan = planner.next_plan()
    first, second = plan.sequences
    assert first.draft_token_ids == (1,)  # 1 output so far, max 3: seed + 1 draft can give at most 2 more
    assert second.token_ids == (20,) and second.draft_token_ids == ()  # budget 3: r0 took 2, the seed fits
    assert sum(len(s.token_ids) for s in plan.sequences) == 3
    planner, _ = _planner([[5]], max_tokens=9, chunk=3)
    planner.update(_answer(planner.next_plan(), {"r0": [10]}))
    planner.set_drafts("r0", [1, 2, 3, 4, 5])
    (seq,) = planner.next_plan().sequences
    assert seq.token_ids == (10, 1, 2) and seq.draft_token_ids == (1, 2)


def test_step_results_that_do_not_fit_the_drafts_are_refused():
    planner, _ = _planner([[5]])
    planner.update(_answer(planner.next_plan(), {"r0": [10]}))
    planner.set_drafts("r0", [1, 2])
    plan = planner.next_plan()
    with pytest.raises(PlanError, match="2 tokens and 2 accepted for 2 drafts"):
        planner.update(_answer(plan, {"r0": [1, 2]}, {"r0": 2}))  # two accepted need the bonus too


def test_sampled_drafts_carry_their_distributions_and_logprobs_split_per_token():
    planner, (request,) = _planner([[5]], temperature=0.7)
    with pytest.raises(PlanError, match="distributions"):
        planner.set_drafts("r0", [1])
    planner.update(_answer(planner.next_plan(), {"r0": [10]}, logprobs=True))
    planner.set_drafts("r0", [1, 2], support_token_ids=[[1, 3], [2]], support_probs=[[0.5, 0.5], [1.0]])
    plan = planner.next_plan()
    (seq,) = plan.sequences
    assert seq.draft_support_token_ids == ((1, 3), (2,)) and seq.draft_support_probs == ((0.5, 0.5), (1.0,))
    planner.update(_answer(plan, {"r0": [1, 7]}, {"r0": 1}, logprobs=True))
    assert request.output_token_ids == [10, 1, 7]
    assert [entry.logprobs for entry in request.logprobs] == [(-1.0,), (-1.0,), (-2.0,)]


def test_oracle_drafts_are_the_plain_continuation():
    from moemesh.bench.fullsize_spec import OracleDrafts

    planner, (request,) = _planner([[5, 6]], max_tokens=7, prefix="o-")
    oracle = OracleDrafts([[10, 11, 12, 13, 14, 15, 16]], "o", width=3)
    oracle.propose(planner)  # nothing: still waiting, not caught up
    plan = planner.next_plan()
    assert plan.sequences[0].draft_token_ids == ()
    planner.update(_answer(plan, {"o-0": [10]}))
    oracle.propose(planner)
    plan = planner.next_plan()
    assert plan.sequences[0].draft_token_ids == (11, 12, 13)
    planner.update(_answer(plan, {"o-0": [11, 12, 13, 14]}, {"o-0": 3}))
    oracle.propose(planner)
    assert request.draft_token_ids == [15]  # 5 of max_tokens 7 generated: one draft at most
    assert oracle.num_short == 0


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
    from moemesh.bench.fullsize_timing import RunResult, StepTiming

    result = RunResult(steps=[
        StepTiming(1, 8, 2, False, 0.0, 1.0),  # prefill: not counted
        StepTiming(2, 8, 2, True, 1.0, 1.2, num_drafts=6, num_accepted=0, num_tokens_gained=2, draft_s=0.1),  # warm-up
        StepTiming(3, 8, 2, True, 2.0, 2.2, num_drafts=6, num_accepted=2, num_tokens_gained=4, draft_s=0.05),
        StepTiming(4, 8, 2, True, 3.0, 3.4, num_drafts=6, num_accepted=4, num_tokens_gained=6, draft_s=0.05),
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
