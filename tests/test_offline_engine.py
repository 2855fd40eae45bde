"""The router's scheduler driven in-process (services/router/offline_engine.py) against a fake worker:
plans on the wire, tokens and logprobs back per request, drafts (accepted + bonus, only once caught
up, never past max_tokens), stop tokens, refusals, per-step timing, slot release after abort_all.

The fake worker stands for the attention worker's answers (its own verification is tested in
tests/test_spec_*.py; the engine against real workers in tests/test_distributed_generate.py)."""

from __future__ import annotations

import pytest

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.message_enums import ErrorCode
from moemesh.common.wire.messages import ErrorReply, SequenceResult, StepResult, TokenLogprobs
from moemesh.services.router.offline_engine import EngineStepError, OfflineEngine
from moemesh.services.router.scheduler import SchedulerConfig

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


class FakeWorker:
    """Answers token 100 + end position per sampled sequence; `accept` drafts per request id."""

    def __init__(self, accept=None, logprobs=False) -> None:
        self.plans = []
        self.accept = accept or {}
        self.logprobs = logprobs

    def __call__(self, plan):
        self.plans.append(plan)
        answers = []
        for seq in plan.sequences:
            tokens = ()
            num_accepted = 0
            if seq.do_sample:
                drafts = seq.draft_token_ids
                num_accepted = min(self.accept.get(seq.request_id, 0), len(drafts))
                end = seq.start_position + len(seq.token_ids) - len(drafts)
                tokens = tuple(drafts[:num_accepted]) + (100 + end + num_accepted,)
            lp = TokenLogprobs(logprobs=tuple(-float(i + 1) for i in range(len(tokens)))) if self.logprobs and tokens else None
            answers.append(SequenceResult(seq.request_id, tokens, num_draft_accepted=num_accepted, logprobs=lp))
        return StepResult(step_id=plan.step_id, sequences=tuple(answers))


def _engine(worker, num_blocks=8, budget=512, **kwargs) -> OfflineEngine:
    config = SchedulerConfig(num_gpu_blocks=num_blocks, max_model_len=num_blocks * 128, max_num_batched_tokens=budget,
                             long_prefill_token_threshold=budget)
    return OfflineEngine(config, worker, **kwargs)


def test_requests_run_to_max_tokens_with_timed_steps():
    worker = FakeWorker()
    engine = _engine(worker)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [4, 5], GREEDY)
    records = []
    outputs = engine.run(on_step=records.append)
    assert outputs["a"].output_token_ids == [103, 104, 105, 106] and outputs["a"].finish_reason == "length"
    assert outputs["b"].output_token_ids == [102, 103, 104, 105]
    first, *decode = records
    assert not first.is_decode and first.num_tokens == 5 and first.num_sequences == 2
    assert all(r.is_decode and r.num_tokens == 2 for r in decode[:3])
    assert all(r.ended_s >= r.began_s for r in records)
    assert [r.step_id for r in records] == [plan.step_id for plan in worker.plans[:len(records)]]
    assert worker.plans[-1].free_seq_slots  # the finished requests' slots are released on the worker


def test_stop_token_and_eos_end_a_request():
    engine = _engine(FakeWorker(), eos_token_ids=(104,))
    engine.add_request("eos", [1, 2, 3], SamplingParams(max_tokens=8))
    engine.add_request("stop", [1], SamplingParams(max_tokens=8, stop_token_ids=(103,)))
    outputs = engine.run()
    assert outputs["eos"].output_token_ids == [103, 104] and outputs["eos"].finish_reason == "stop"
    assert outputs["stop"].output_token_ids == [101, 102, 103] and outputs["stop"].finish_reason == "stop"


def test_drafts_ride_along_once_caught_up_and_never_past_max_tokens():
    worker = FakeWorker(accept={"r": 2}, logprobs=True)
    engine = _engine(worker)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True, num_logprobs=0))
    assert engine.draft_candidates() == []  # still waiting: not caught up
    engine.step()
    ((request, num_drafts),) = engine.draft_candidates()
    assert request.request_id == "r" and num_drafts == 3  # 1 of 5 generated: the seed + 3 drafts give 4 more
    engine.set_drafts("r", [1, 2, 3, 4])
    record = engine.step()
    (seq,) = worker.plans[-1].sequences
    assert seq.token_ids == (103, 1, 2, 3) and seq.draft_token_ids == (1, 2, 3)
    assert record.num_drafts == 3 and record.num_accepted == 2 and record.num_tokens_gained == 3
    output = engine.outputs["r"]
    assert output.output_token_ids == [103, 1, 2, 106]
    assert [entry.logprobs for entry in output.logprobs] == [(-1.0,), (-1.0,), (-2.0,), (-3.0,)]
    assert engine.draft_candidates() == []  # 4 of 5 generated: the seed alone reaches max_tokens
    engine.run()
    assert output.output_token_ids == [103, 1, 2, 106, 107] and output.num_accepted_drafts == 2


def test_send_features_marks_every_sequence():
    worker = FakeWorker()
    engine = _engine(worker, send_features=True)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=1))
    engine.run()
    assert all(seq.send_features for plan in worker.plans for seq in plan.sequences)


def test_a_refused_step_raises():
    engine = _engine(lambda plan: ErrorReply(code=ErrorCode.INTERNAL, message="no"))
    engine.add_request("a", [1], GREEDY)
    with pytest.raises(EngineStepError, match="refused"):
        engine.step()


def test_abort_all_releases_the_slots_in_the_next_step():
    worker = FakeWorker()
    engine = _engine(worker)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_all()
    assert engine.done and engine.outputs["a"].finish_reason == "abort"
    engine.step()
    assert worker.plans[-1].sequences == () and worker.plans[-1].free_seq_slots


def test_a_reused_slot_is_released_by_a_plan_of_its_own_and_the_step_names_the_computing_plan():
    worker = FakeWorker()
    config = SchedulerConfig(num_gpu_blocks=4, max_model_len=512, max_num_running_seqs=1)
    engine = OfflineEngine(config, worker)
    engine.add_request("a", [1], SamplingParams(max_tokens=1))
    engine.add_request("b", [2], SamplingParams(max_tokens=1))
    engine.step()  # a runs and finishes
    record = engine.step()  # b takes a's slot
    release, compute = worker.plans[-2:]
    assert release.sequences == () and release.free_seq_slots == (0,)
    assert [seq.request_id for seq in compute.sequences] == ["b"] and record.step_id == compute.step_id
