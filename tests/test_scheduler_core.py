"""Scheduler core: budgets, chunked prefill, decode priority, stop conditions, deadlines, errors."""

from __future__ import annotations

import random

import pytest

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.scheduler import (
    FinishReason,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SequenceResult,
)
from sim_engine_support import SimulatedEngine


def make_config(**overrides) -> SchedulerConfig:
    values = dict(num_gpu_blocks=64, max_model_len=4096, num_cpu_blocks=16)
    values.update(overrides)
    return SchedulerConfig(**values)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 8, seed: int = 0, **kwargs) -> Request:
    rng = random.Random(f"{request_id}/{seed}")
    prompt = tuple(rng.randrange(1000) for _ in range(num_prompt_tokens))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=kwargs.pop("stop_token_ids", ()))
    return Request(request_id, prompt, params, **kwargs)


def assert_pools_initial(scheduler: Scheduler) -> None:
    stats = scheduler.stats()
    assert stats.num_gpu_blocks_used == 0
    assert stats.num_cpu_blocks_used == 0
    assert stats.num_free_state_slots == scheduler.config.max_num_running_seqs
    assert stats.num_running_seqs == stats.num_swapped_seqs == stats.num_waiting_requests == 0
    assert stats.num_waiting_prompt_tokens == 0


def test_budget_cap_and_running_limit_hold_every_step():
    config = make_config(
        num_gpu_blocks=48, max_num_batched_tokens=300, long_prefill_token_threshold=200, max_num_running_seqs=5
    )
    engine = SimulatedEngine(Scheduler(config))
    rng = random.Random(1)
    for index in range(20):
        engine.add(make_request(f"r{index}", rng.randint(1, 900), max_tokens=rng.randint(1, 40)))

    def check(record):
        plan = record.plan
        assert plan.num_scheduled_tokens == sum(seq.num_tokens for seq in plan.scheduled)
        assert plan.num_scheduled_tokens <= config.max_num_batched_tokens
        assert all(1 <= seq.num_tokens <= config.long_prefill_token_threshold for seq in plan.scheduled)
        assert len(plan.scheduled) <= config.max_num_running_seqs
        slots = [seq.state_slot for seq in plan.scheduled]
        assert len(set(slots)) == len(slots)
        assert engine.scheduler.stats().num_running_seqs <= config.max_num_running_seqs

    engine.run_until_done(max_steps=2000, on_step=check)
    for request in engine.requests.values():
        assert request.finish_reason is FinishReason.LENGTH
        assert request.output_token_ids == engine.expected_output(request, request.sampling_params.max_tokens)
    assert_pools_initial(engine.scheduler)


def test_short_request_gets_first_token_while_long_prompt_is_still_prefilling():
    config = make_config(short_request_window_s=0, num_gpu_blocks=80, max_model_len=8192)
    engine = SimulatedEngine(Scheduler(config))
    engine.add(make_request("long", 5000, max_tokens=4))
    engine.add(make_request("short", 10, max_tokens=4))
    first = engine.step()
    by_id = {seq.request_id: seq for seq in first.plan.scheduled}
    assert by_id["long"].num_tokens == 1024 and not by_id["long"].sample_logits
    assert by_id["short"].num_tokens == 10 and by_id["short"].sample_logits
    assert [event.request_id for event in first.events] == ["short"]
    assert len(first.events[0].new_token_ids) == 1
    # The long prompt needs ceil(5000 / 1024) = 5 steps before its first token.
    steps_to_first_long_token = 1
    while not engine.events["long"]:
        engine.step()
        steps_to_first_long_token += 1
    assert steps_to_first_long_token == 5


def test_long_prompt_sits_out_one_step_for_a_short_arrival_and_never_two_in_a_row():
    config = make_config(short_request_window_s=0, num_gpu_blocks=80, max_model_len=8192)
    engine = SimulatedEngine(Scheduler(config))
    engine.add(make_request("long", 5000, max_tokens=2))
    assert [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled] == [("long", 1024)]
    engine.add(make_request("short-a", 10, max_tokens=3))
    # the short prompt starts alone: its first token does not wait on a chunk over the long history
    step = engine.step()
    assert [(s.request_id, s.num_tokens) for s in step.plan.scheduled] == [("short-a", 10)]
    assert [event.request_id for event in step.events] == ["short-a"]
    engine.add(make_request("short-b", 10, max_tokens=3))
    # the long prompt sat out the last step, so this one it runs beside the new arrival
    step = engine.step()
    assert [(s.request_id, s.num_tokens) for s in step.plan.scheduled] == [
        ("short-a", 1), ("long", 1024), ("short-b", 10)
    ]
    assert engine.requests["long"].num_computed_tokens == 2048
    # a waiting prompt longer than one chunk does not make the long prompt sit out
    engine.add(make_request("second-long", 1500, max_tokens=1))
    plan = engine.step().plan
    assert ("long", 1024) in [(s.request_id, s.num_tokens) for s in plan.scheduled]


def test_long_prompt_chunks_shrink_while_short_requests_are_about():
    """Within short_request_window_s of a short arrival a long prompt computes shared_prefill_token_threshold tokens
    a step (a short request then waits on a short chunk in flight); alone, full chunks."""
    now = [0.0]
    config = make_config(num_gpu_blocks=80, max_model_len=8192, short_request_window_s=2.0,
                         shared_prefill_token_threshold=256)
    engine = SimulatedEngine(Scheduler(config, clock=lambda: now[0]))
    engine.add(make_request("long", 6000, max_tokens=2))
    assert [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled] == [("long", 1024)]
    now[0] = 10.0
    engine.add(make_request("short", 10, max_tokens=2))
    assert [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled] == [("short", 10)]  # sits out
    now[0] = 10.5
    assert ("long", 256) in [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled]
    now[0] = 11.9
    assert [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled] == [("long", 256)]
    now[0] = 12.0  # the window has passed
    assert [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled] == [("long", 1024)]
    engine.add(make_request("second-long", 3000, max_tokens=1))  # a long arrival does not shrink chunks
    assert ("long", 1024) in [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled]
    engine.run_until_done(max_steps=100)
    assert engine.requests["long"].output_token_ids == engine.expected_output(engine.requests["long"], 2)


def test_short_prefills_go_in_graph_sized_chunks_when_the_attention_worker_replays_graphs():
    """graph_chunk_tokens (8) and graph_prefill_token_threshold (20): a prompt of at most 20 tokens computes 8 a step,
    decodes stay one token (plus drafts) a step, a longer prompt its usual chunks until at most 20 are left; without
    graphs (graph_chunk_tokens 0) one chunk as ever. Outputs are what the whole-prompt steps give."""
    config = make_config(num_gpu_blocks=80, max_model_len=8192, short_request_window_s=0,
                         graph_chunk_tokens=8, graph_step_tokens=64, graph_prefill_token_threshold=20)
    engine = SimulatedEngine(Scheduler(config))
    engine.add(make_request("short", 19, max_tokens=3))
    chunks = [[(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled] for _ in range(4)]
    assert chunks == [[("short", 8)], [("short", 8)], [("short", 3)], [("short", 1)]]
    engine.add(make_request("long", 1040, max_tokens=2))
    assert ("long", 1024) in [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled]
    assert ("long", 8) in [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled]  # 16 left
    engine.run_until_done(max_steps=100)
    for request_id, max_tokens in (("short", 3), ("long", 2)):
        assert engine.requests[request_id].output_token_ids == engine.expected_output(engine.requests[request_id],
                                                                                       max_tokens)
    eager = SimulatedEngine(Scheduler(make_config(num_gpu_blocks=80, max_model_len=8192, graph_chunk_tokens=0,
                                                  graph_prefill_token_threshold=20)))
    eager.add(make_request("short", 19, max_tokens=3))
    assert [(s.request_id, s.num_tokens) for s in eager.step().plan.scheduled] == [("short", 19)]


def test_a_busy_step_keeps_short_prompts_whole():
    """More live sequences than graph_step_tokens / graph_chunk_tokens (9 x 8 > 64): the step may run eagerly, so a
    short prompt computes its whole chunk; once few enough are left, graph-sized chunks again."""
    config = make_config(num_gpu_blocks=80, max_model_len=8192, short_request_window_s=0,
                         graph_chunk_tokens=8, graph_step_tokens=64, graph_prefill_token_threshold=40)
    engine = SimulatedEngine(Scheduler(config))
    for index in range(8):
        engine.add(make_request(f"decode-{index}", 4, max_tokens=3))
    engine.add(make_request("short", 30, max_tokens=2))
    plan = engine.step().plan
    assert ("short", 30) in [(s.request_id, s.num_tokens) for s in plan.scheduled]
    engine.run_until_done(max_steps=100)
    engine.add(make_request("alone", 30, max_tokens=2))
    assert [(s.request_id, s.num_tokens) for s in engine.step().plan.scheduled] == [("alone", 8)]
    with pytest.raises(ValueError, match="graph_step_tokens=4 must be >= graph_chunk_tokens=8"):
        make_config(graph_chunk_tokens=8, graph_step_tokens=4)


def test_long_prompt_runs_when_the_short_arrival_cannot_be_admitted():
    config = make_config(short_request_window_s=0, num_gpu_blocks=41, max_model_len=5120, num_cpu_blocks=0,
                         max_num_running_seqs=1)
    engine = SimulatedEngine(Scheduler(config))
    engine.add(make_request("long", 5000, max_tokens=2))
    engine.step()
    engine.add(make_request("short", 10, max_tokens=2))  # no free running slot: it waits
    plan = engine.step().plan
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("long", 1024)]
    engine.run_until_done(max_steps=100)
    assert engine.requests["short"].finish_reason is FinishReason.LENGTH


def test_long_prompt_runs_when_the_pool_refuses_the_short_arrival(monkeypatch):
    engine = SimulatedEngine(Scheduler(make_config(short_request_window_s=0, num_gpu_blocks=80, max_model_len=8192)))
    engine.add(make_request("long", 5000, max_tokens=2))
    engine.step()
    engine.add(make_request("short", 10, max_tokens=2))
    monkeypatch.setattr(engine.scheduler.kv, "can_admit", lambda *args: False)
    plan = engine.step().plan
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("long", 1024)]
    monkeypatch.undo()
    plan = engine.step().plan  # it sat out no step, so the short arrival goes first now
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("short", 10)]


def test_chunked_prefill_positions_and_token_ids():
    config = make_config(long_prefill_token_threshold=128)
    engine = SimulatedEngine(Scheduler(config))
    request = make_request("r", 300, max_tokens=3)
    engine.add(request)
    chunks = [engine.step().plan.scheduled[0] for _ in range(3)]
    assert [seq.start_position for seq in chunks] == [0, 128, 256]
    assert [seq.num_tokens for seq in chunks] == [128, 128, 44]
    assert [seq.sample_logits for seq in chunks] == [False, False, True]
    assert [seq.is_new_sequence for seq in chunks] == [True, False, False]
    for seq in chunks:
        assert seq.token_ids == request.prompt_token_ids[seq.start_position : seq.start_position + seq.num_tokens]
        assert len(seq.block_ids) * config.block_size_tokens >= seq.start_position + seq.num_tokens
    assert request.num_computed_tokens == 300 and request.num_output_tokens == 1
    decode = engine.step().plan.scheduled[0]
    assert (decode.start_position, decode.token_ids) == (300, (request.output_token_ids[0],))
    assert decode.sample_logits and len(decode.block_ids) == 3


def test_decodes_are_scheduled_before_continuing_prefills():
    config = make_config(max_num_batched_tokens=100, long_prefill_token_threshold=90)
    engine = SimulatedEngine(Scheduler(config))
    engine.add(make_request("long", 1000, max_tokens=2))
    engine.add(make_request("short", 10, max_tokens=5))
    first = engine.step().plan
    assert [(s.request_id, s.num_tokens) for s in first.scheduled] == [("long", 90), ("short", 10)]
    second = engine.step().plan
    # "short" was admitted later but decodes first; the prefill gets the rest of the budget.
    assert [(s.request_id, s.num_tokens) for s in second.scheduled] == [("short", 1), ("long", 90)]
    third = engine.step().plan
    assert third.num_scheduled_tokens <= 100


def test_stop_token_eos_and_max_tokens():
    scheduler = Scheduler(make_config())
    scheduler.add_request(Request("eos", (1, 2, 3), SamplingParams(max_tokens=10), eos_token_ids=(7,)))
    scheduler.add_request(
        Request("ignore", (1, 2, 3), SamplingParams(max_tokens=2, ignore_eos=True), eos_token_ids=(7,))
    )
    scheduler.add_request(Request("stop", (1, 2, 3), SamplingParams(max_tokens=10, stop_token_ids=(9,))))
    plan = scheduler.schedule()
    results = {seq.request_id: SequenceResult((7,)) for seq in plan.scheduled}
    results["stop"] = SequenceResult((8,))
    events = {event.request_id: event for event in scheduler.update(plan, results)}
    assert events["eos"].finish_reason is FinishReason.STOP and events["eos"].new_token_ids == (7,)
    assert events["ignore"].finish_reason is None
    assert events["stop"].finish_reason is None
    plan = scheduler.schedule()
    assert plan.freed_request_ids == ("eos",)  # the worker frees the slot of a finished request
    results = {"ignore": SequenceResult((7,)), "stop": SequenceResult((9,))}
    events = {e.request_id: e for e in scheduler.update(plan, results)}
    assert events["ignore"].finish_reason is FinishReason.LENGTH
    assert events["stop"].finish_reason is FinishReason.STOP
    assert scheduler.num_unfinished_requests == 0
    assert_pools_initial(scheduler)
    assert set(scheduler.schedule().freed_request_ids) == {"ignore", "stop"}


def test_max_model_len_bounds_output():
    scheduler = Scheduler(make_config(max_model_len=256, num_gpu_blocks=2))
    request = Request("r", tuple(range(250)), SamplingParams(max_tokens=100, ignore_eos=True))
    scheduler.add_request(request)
    num_steps = 0
    while scheduler.num_unfinished_requests:
        plan = scheduler.schedule()
        scheduler.update(plan, {seq.request_id: SequenceResult((5,)) for seq in plan.scheduled if seq.sample_logits})
        num_steps += 1
    assert request.num_tokens == 256 and request.finish_reason is FinishReason.LENGTH and num_steps == 6


def test_deadline_finishes_waiting_and_running_requests():
    now = [0.0]
    config = make_config(max_num_running_seqs=1)
    scheduler = Scheduler(config, clock=lambda: now[0])
    scheduler.add_request(make_request("running", 10, max_tokens=100, deadline_s=5.0))
    scheduler.add_request(make_request("waiting", 10, max_tokens=100, deadline_s=2.0))
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.scheduled] == ["running"]
    assert scheduler.update(plan, {"running": SequenceResult((1,))})[0].finish_reason is None
    now[0] = 3.0
    plan = scheduler.schedule()
    events = scheduler.update(plan, {"running": SequenceResult((1,))})
    assert [(e.request_id, e.finish_reason) for e in events if e.is_finished] == [("waiting", FinishReason.DEADLINE)]
    now[0] = 6.0
    plan = scheduler.schedule()
    events = scheduler.update(plan, {"running": SequenceResult((1,))})
    assert events[-1].request_id == "running" and events[-1].finish_reason is FinishReason.DEADLINE
    assert_pools_initial(scheduler)


def test_worker_error_and_missing_result_finish_with_error():
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10))
    plan = scheduler.schedule()
    events = {e.request_id: e for e in scheduler.update(plan, {"a": SequenceResult(error="device lost")})}
    assert events["a"].finish_reason is FinishReason.ERROR and events["a"].error == "device lost"
    assert events["b"].finish_reason is FinishReason.ERROR and "no result" in events["b"].error
    assert_pools_initial(scheduler)


def test_abort_frees_everything_in_every_state():
    config = make_config(num_gpu_blocks=8, max_model_len=1024, num_cpu_blocks=8, max_num_running_seqs=2)
    engine = SimulatedEngine(Scheduler(config))
    for index in range(4):
        engine.add(make_request(f"r{index}", 500, max_tokens=400))
    for _ in range(12):
        engine.step()
    statuses = {engine.requests[f"r{i}"].status for i in range(4)}
    assert RequestStatus.RUNNING in statuses and RequestStatus.WAITING in statuses
    # Abort one request while its step is in flight: the result is ignored, the slot announced.
    plan = engine.scheduler.schedule()
    in_flight = plan.scheduled[0].request_id
    assert engine.scheduler.abort(in_flight).finish_reason is FinishReason.ABORT
    engine.scheduler.update(plan, engine.worker.execute(plan))
    next_plan = engine.scheduler.schedule()
    assert in_flight in next_plan.freed_request_ids
    engine.scheduler.update(next_plan, engine.worker.execute(next_plan))
    for request_id in list(engine.requests):
        engine.scheduler.abort(request_id)
    assert engine.scheduler.abort("r0") is None
    assert_pools_initial(engine.scheduler)


def test_schedule_and_update_must_alternate():
    scheduler = Scheduler(make_config())
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    scheduler.update(plan, {})
    with pytest.raises(RuntimeError):
        scheduler.update(plan, {})


def test_invalid_requests_and_configs_are_refused():
    scheduler = Scheduler(make_config(max_model_len=256, num_gpu_blocks=2))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("too_long", 256))
    scheduler.add_request(make_request("ok", 255))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("ok", 10))
    with pytest.raises(ValueError):
        SchedulerConfig(num_gpu_blocks=8, max_model_len=1024, block_size_tokens=100)
    with pytest.raises(ValueError):
        SchedulerConfig(num_gpu_blocks=7, max_model_len=1024)  # one max-length request must fit
    with pytest.raises(ValueError):
        Request("empty", ())
