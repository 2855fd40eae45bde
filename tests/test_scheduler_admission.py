"""Admission: bounded waiting queue and queued prompt tokens, retry-after from throughput."""

from __future__ import annotations

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.scheduler import (
    AdmissionController,
    AdmissionLimits,
    RejectReason,
    Request,
    Scheduler,
    SchedulerConfig,
    SequenceResult,
    ThroughputMeter,
    estimate_prompt_tokens,
)


def test_estimate_prompt_tokens_from_bytes():
    assert estimate_prompt_tokens(0) == 1
    assert estimate_prompt_tokens(4000) == 1000
    assert estimate_prompt_tokens(4001) == 1001
    assert estimate_prompt_tokens(300, bytes_per_token=3.0) == 100


def test_throughput_meter_measures_recent_tokens_per_second():
    meter = ThroughputMeter(window_s=10.0)
    assert meter.tokens_per_second(0.0) is None
    meter.record(0.0, 500)
    assert meter.tokens_per_second(0.0) is None
    for second in range(1, 5):
        meter.record(float(second), 1000)
    assert meter.tokens_per_second(4.0) == 1000.0
    assert meter.tokens_per_second(100.0) is None  # everything left the window


def test_refusal_by_queue_length_and_by_queued_tokens():
    meter = ThroughputMeter()
    controller = AdmissionController(AdmissionLimits(max_waiting_requests=2, max_waiting_prompt_tokens=1000), meter)
    ok = controller.decide(now_s=0.0, num_waiting_requests=1, num_waiting_prompt_tokens=100, estimated_prompt_tokens=50)
    assert ok.admitted and ok.retry_after_seconds is None
    full = controller.decide(now_s=0.0, num_waiting_requests=2, num_waiting_prompt_tokens=100, estimated_prompt_tokens=50)
    assert not full.admitted and full.reject_reason is RejectReason.TOO_MANY_WAITING_REQUESTS
    assert full.retry_after_seconds == 60  # no throughput measured yet: the maximum
    heavy = controller.decide(now_s=0.0, num_waiting_requests=1, num_waiting_prompt_tokens=900, estimated_prompt_tokens=200)
    assert not heavy.admitted and heavy.reject_reason is RejectReason.TOO_MANY_WAITING_PROMPT_TOKENS
    # A prompt larger than the token bound still enters an empty queue.
    big = controller.decide(now_s=0.0, num_waiting_requests=0, num_waiting_prompt_tokens=0, estimated_prompt_tokens=5000)
    assert big.admitted


def test_retry_after_follows_measured_throughput():
    meter = ThroughputMeter()
    controller = AdmissionController(AdmissionLimits(max_waiting_requests=100, max_waiting_prompt_tokens=10_000), meter)
    for second in range(6):
        meter.record(float(second), 1000)  # 1000 tokens/s
    decision = controller.decide(
        now_s=5.0, num_waiting_requests=10, num_waiting_prompt_tokens=10_000, estimated_prompt_tokens=5000
    )
    assert decision.retry_after_seconds == 5  # 5000 excess tokens at 1000 tokens/s
    tiny = controller.decide(now_s=5.0, num_waiting_requests=10, num_waiting_prompt_tokens=10_000, estimated_prompt_tokens=1)
    assert tiny.retry_after_seconds == 1  # clamped from below


def test_scheduler_admission_counts_only_waiting_requests():
    now = [0.0]
    config = SchedulerConfig(num_gpu_blocks=8, max_model_len=1024, max_waiting_requests=2, max_waiting_prompt_tokens=500)
    scheduler = Scheduler(config, clock=lambda: now[0])
    for request_id in ("a", "b"):
        assert scheduler.check_admission(100).admitted
        scheduler.add_request(Request(request_id, tuple(range(100)), SamplingParams(max_tokens=20)))
    assert scheduler.stats().num_waiting_requests == 2 and scheduler.stats().num_waiting_prompt_tokens == 200
    refused = scheduler.check_admission(100)
    assert not refused.admitted and refused.reject_reason is RejectReason.TOO_MANY_WAITING_REQUESTS
    for step in range(3):
        now[0] = float(step)
        plan = scheduler.schedule()
        scheduler.update(plan, {seq.request_id: SequenceResult((1,)) for seq in plan.scheduled})
    assert scheduler.stats().num_waiting_requests == 0 and scheduler.check_admission(400).admitted
    assert scheduler.meter.tokens_per_second(2.0) == 2.0  # two decode tokens per second after the prompts
