"""The router's cost-aware width policy (services/router/spec_cost.py, spec_policy.py, engine_drafts.py).

A real Scheduler and DraftCoordinator with a drafter function that answers fixed confidences; the
cost model is fixed (deterministic) or learned from synthetic step timings. No torch.
"""

from __future__ import annotations

import asyncio

import pytest

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import DraftProposal, DraftTokens
from moemesh.common.speculation_width import cost_aware_widths, survival_curve
from moemesh.services.router.drafter_link import width_policy_from_env
from moemesh.services.router.engine_drafts import DraftConfig, DraftCoordinator
from moemesh.services.router.engine_plan import PlanTranslator
from moemesh.services.router.scheduler import Request, Scheduler, SchedulerConfig, SequenceResult
from moemesh.services.router.spec_cost import FixedStepCost, MedianLine, OnlineStepCost, RecentMedian, bucket_of
from moemesh.services.router.scheduler.output import RequestEvent
from moemesh.services.router.spec_policy import AcceptanceCalibration, CostAwareWidths, CostPolicyConfig, WidthPolicyKind

CONFIDENCES = {"a": (0.9, 0.9, 0.9, 0.9, 0.9), "b": (0.8, 0.5, 0.5, 0.5, 0.5), "c": (0.4, 0.4, 0.4, 0.4, 0.4)}


class Drafter:
    """Answers every slot with its request's fixed confidences (cut to the slot's cap)."""

    def __init__(self) -> None:
        self.requests = []

    async def __call__(self, request):
        self.requests.append(request)
        proposals = []
        for slot in request.slots:
            confidences = CONFIDENCES[slot.request_id][:slot.num_draft_tokens]
            ids = tuple(range(50, 50 + len(confidences)))
            proposals.append(DraftProposal(slot.request_id, ids, (0.5,) * len(ids), confidences))
        return DraftTokens(step_id=request.step_id, proposals=tuple(proposals))


def _decoding(scheduler):
    """Three requests past their prefill: the next step of each computes one known token."""
    for request_id in CONFIDENCES:
        scheduler.add_request(Request(request_id, (1, 2, 3), SamplingParams(max_tokens=50)))
    output = scheduler.schedule()
    return scheduler.update(output, {request_id: SequenceResult((9,)) for request_id in CONFIDENCES})


def _coordinator(cost, drafter, probe_every_steps=8):
    config = DraftConfig(max_draft_tokens=5, width_policy=WidthPolicyKind.COST,
                         cost_policy=CostPolicyConfig(probe_every_steps=probe_every_steps,
                                                      min_calibration_drafts=0, explore_new_requests=False))
    return DraftCoordinator(config, drafter, cost=cost)


def _scheduled_drafts(scheduler):
    return {request_id: len(scheduler.get_request(request_id).draft_token_ids) for request_id in CONFIDENCES}


def test_fixed_cost_model_cuts_each_proposal_to_the_objectives_widths():
    cost = FixedStepCost(base_s=0.020, per_token_s=0.004, draft_s=0.005)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, max_model_len=512))
    drafter = Drafter()
    drafts = _coordinator(cost, drafter)
    asyncio.run(drafts.after_step(scheduler, _decoding(scheduler)))
    assert len(drafter.requests) == 1
    # the same choice by hand: cycle = 20 ms + 4 ms x (3 + K) + 5 ms drafter. Candidates: a's 0.9^k
    # (0.9, 0.81, 0.73, 0.66, 0.59), b's 0.8, 0.4, 0.2, ..., c's 0.4, 0.16, ...; a draft pays while its
    # survival exceeds the step's rate x 4 ms: rate 3 / 37 ms -> 0.32 at first, rising to ~0.48 at K = 6
    got = _scheduled_drafts(scheduler)
    survivals = [survival_curve(CONFIDENCES[r]) for r in CONFIDENCES]
    expected = cost_aware_widths(survivals, lambda k: 0.020 + 0.004 * (3 + k) + 0.005).widths
    assert tuple(got.values()) == expected == (5, 1, 0)
    stats = drafts.stats()
    assert stats["spec_width_policy"] == "cost"
    assert stats["spec_policy_num_proposed_drafts"] == 15
    assert stats["spec_policy_num_cut_drafts"] == 15 - sum(got.values())


def test_free_verification_keeps_every_proposed_draft():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, max_model_len=512))
    drafts = _coordinator(FixedStepCost(base_s=0.020, per_token_s=0.0), Drafter())
    asyncio.run(drafts.after_step(scheduler, _decoding(scheduler)))
    assert _scheduled_drafts(scheduler) == {"a": 5, "b": 5, "c": 5}


def test_when_drafting_cannot_pay_the_drafter_is_asked_only_to_probe():
    # a drafter round trip of 200 ms against a 20 ms step: no width can pay for it
    cost = FixedStepCost(base_s=0.020, per_token_s=0.001, draft_s=0.200)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, max_model_len=512))
    drafter = Drafter()
    drafts = _coordinator(cost, drafter, probe_every_steps=3)
    events = _decoding(scheduler)
    asyncio.run(drafts.after_step(scheduler, events))  # no survival curve yet: asks (and learns it)
    assert len(drafter.requests) == 1
    asked, verified = [], []
    for _ in range(18):
        output = scheduler.schedule()
        verified.append(output.num_draft_tokens > 0)
        events = scheduler.update(output, {seq.request_id: SequenceResult((9,)) for seq in output.scheduled})
        before = len(drafter.requests)
        asyncio.run(drafts.after_step(scheduler, events))
        asked.append(len(drafter.requests) - before)
    # three plain steps, a probe; as the probe found drafting still not paying: six, a probe; then twelve
    assert asked == [0, 0, 0, 1] + [0] * 6 + [1] + [0] * 7
    # drafts that were asked for are used (their round trip is paid already): only after an ask
    assert verified == [True, False, False, False, True] + [False] * 6 + [True] + [False] * 6
    stats = drafts.stats()
    assert stats["spec_policy_num_skipped_steps"] == 16 and stats["spec_policy_num_probe_steps"] == 2


def test_the_drafter_policy_keeps_the_drafters_widths():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, max_model_len=512))
    drafts = DraftCoordinator(DraftConfig(max_draft_tokens=5), Drafter())
    assert drafts.widths is None
    asyncio.run(drafts.after_step(scheduler, _decoding(scheduler)))
    assert _scheduled_drafts(scheduler) == {"a": 5, "b": 5, "c": 5}
    assert drafts.stats()["spec_width_policy"] == "drafter"


def test_width_policy_from_the_environment():
    assert width_policy_from_env({}) is WidthPolicyKind.DRAFTER
    assert width_policy_from_env({"MOEMESH_SPEC_WIDTH_POLICY": "cost"}) is WidthPolicyKind.COST
    assert width_policy_from_env({"MOEMESH_SPEC_WIDTH_POLICY": " Drafter "}) is WidthPolicyKind.DRAFTER
    with pytest.raises(ValueError, match="choose one of drafter, cost"):
        width_policy_from_env({"MOEMESH_SPEC_WIDTH_POLICY": "fast"})


# -- the learned cost model -----------------------------------------------------------------------


def test_median_line_recovers_a_line_shrugs_off_outliers_and_forgets():
    line = MedianLine(per_x=8, max_age=50)
    for _ in range(5):
        line.add(8, 0.030)
    assert line.fit(min_spread=1.0) is None  # one token count: the slope is not identified
    for tokens in (16, 24, 48, 8, 30):
        line.add(tokens, 0.010 + 0.0025 * tokens)
    intercept, slope = line.fit(min_spread=1.0)
    assert intercept == pytest.approx(0.010) and slope == pytest.approx(0.0025)
    line.add(8, 1.5)  # a first CUDA call: the median at 8 tokens does not move
    assert line.fit(min_spread=1.0) == pytest.approx((0.010, 0.0025))
    falling = MedianLine()
    for tokens, seconds in ((8, 0.050), (48, 0.030), (8, 0.050), (48, 0.030)):
        falling.add(tokens, seconds)
    assert falling.fit(min_spread=1.0)[1] == 0.0  # a falling fit is clamped: drafts are never free money
    fading = MedianLine(max_age=50)
    fading.add(3, 0.030)  # one verify step ...
    for _ in range(60):  # ... forgotten under plain steps
        fading.add(1, 0.020)
    assert fading.fit(min_spread=1.0) is None
    fading.add(3, 0.030)  # one fresh verify step two tokens wider identifies the slope again
    assert fading.fit(min_spread=1.0) == pytest.approx((0.015, 0.005))


def test_recent_median_waits_for_a_few_values():
    median = RecentMedian(maxlen=5, min_count=3)
    median.add(1.2)  # a cold first round trip
    median.add(0.020)
    assert median.value() is None
    median.add(0.022)
    assert median.value() == pytest.approx(0.022)
    for _ in range(5):
        median.add(0.010)
    assert median.value() == pytest.approx(0.010)  # only the last five count


def test_online_cost_learns_per_bucket_from_the_engines_steps():
    cost = OnlineStepCost(min_observations=3)
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert cost.attention_line(8) is None and cost.draft_round_trip_s(8) is None
    for tokens in (8, 48, 8, 28, 48):  # 8 sequences: plain steps and verify steps
        cost.observe_attention(8, tokens, 0.060 + 0.002 * tokens)
    cost.observe_attention(1, 6, 0.046)
    base_s, per_token_s = cost.attention_line(7)  # 7 sequences: the 8 bucket
    assert base_s == pytest.approx(0.060) and per_token_s == pytest.approx(0.002)
    assert cost.attention_line(1) == (base_s, per_token_s)  # one step in that bucket: the nearest bucket's line
    for tokens in (1, 3, 1):
        cost.observe_attention(1, tokens, 0.040 + 0.001 * tokens)
    assert cost.attention_line(1) == pytest.approx((0.040, 0.001))  # its own line once it has one
    assert cost.attention_line(2) == pytest.approx((0.040, 0.001))  # 2: nearer to 1 than to 8
    for seconds in (0.030, 0.031, 0.029):
        cost.observe_draft(8, seconds)
    assert cost.draft_round_trip_s(5) == pytest.approx(0.030)
    assert cost.draft_round_trip_s(1) == pytest.approx(0.030)  # none of its own yet: the nearest bucket's
    assert OnlineStepCost().draft_round_trip_s(1) is None
    summary = cost.summary()["buckets"]["8"]
    assert summary["num_steps"] == 5 and summary["attention_ms_per_token"] == pytest.approx(2.0)


class _Seq:
    def __init__(self, num_tokens, num_drafts, new=False):
        self.token_ids = (1,) * num_tokens
        self.draft_token_ids = (2,) * num_drafts
        self.is_new_sequence = new


def test_policy_learns_only_from_decode_steps_and_explores_until_the_line_is_known():
    cost = OnlineStepCost(min_observations=2)
    policy = CostAwareWidths(CostPolicyConfig(min_calibration_drafts=0), cost)  # the head trusted at once
    policy.observe_draft(4, 0.010)
    confidences = [(0.9, 0.9, 0.9)] * 4
    # nothing seen: keep the drafter's widths
    assert policy.choose_widths(confidences, num_sequences=4) == [3, 3, 3, 3]
    policy.observe_step([_Seq(4, 3)] * 4, 0.040, now_s=1.0)  # a verify step of 16 tokens
    policy.observe_step([_Seq(100, 0, new=True)] * 4, 0.500, now_s=2.0)  # a prefill: not a decode step
    assert cost.mean_tokens(4) == 16
    # only drafted steps seen: verify nothing once, to see the plain step
    assert policy.choose_widths(confidences, num_sequences=4) == [0, 0, 0, 0]
    policy.observe_step([_Seq(1, 0)] * 4, 0.016, now_s=3.0)
    assert cost.attention_line(4) is not None
    assert policy.counters.num_explore_steps == 2
    # line through (4, 16 ms) and (16, 40 ms): 2 ms per token, 8 ms base; with 12 drafts the cycle commits
    # 13.8 tokens in 50 ms (0.28 per ms): every draft (survival >= 0.73) beats the 0.55 its 2 ms cost
    assert policy.choose_widths(confidences, num_sequences=4) == [3, 3, 3, 3]


def test_the_router_side_of_the_policy_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; import moemesh.services.router.engine, moemesh.services.router.engine_drafts, moemesh.services.router.spec_policy; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_drafting_resumes_when_the_learned_costs_say_it_pays_again():
    cost = OnlineStepCost(min_observations=2)
    for tokens in (4, 12, 4, 12):  # 4 sequences: 10 ms + 1 ms per token
        cost.observe_attention(4, tokens, 0.010 + 0.001 * tokens)
    policy = CostAwareWidths(CostPolicyConfig(probe_every_steps=2, max_probe_every_steps=4,
                                               min_calibration_drafts=0), cost)
    for _ in range(3):
        policy.observe_draft(4, 0.200)  # a drafter slower than ten steps
    policy.choose_widths([(0.9, 0.9)] * 4, num_sequences=4)  # the survival curve, from one proposal
    decisions = [policy.should_draft(4, 4) for _ in range(12)]
    assert decisions == [False, False, True, False, False, False, False, True, False, False, False, False]
    for _ in range(12):
        policy.observe_draft(4, 0.001)  # the drafter got fast (another device, less load)
    assert policy.should_draft(4, 4) and policy.should_draft(4, 4)  # pays: asked every step again


def test_calibration_scales_the_heads_survival_to_what_verification_accepts():
    calibration = AcceptanceCalibration(decay=1.0, prior_weight=2.0)
    assert calibration.apply([0.5, 0.25]) == [0.5, 0.25]  # nothing verified yet: the head as it is
    for _ in range(8):  # an under-confident head: slot 0 predicted 0.5 and always accepted, slot 1 0.25 never
        calibration.add([0.5, 0.25], num_accepted=1)
    assert calibration.factor(0) == pytest.approx((8 + 2) / (4 + 2))
    assert calibration.factor(1) == pytest.approx((0 + 2) / (2 + 2))
    assert calibration.apply([0.5, 0.25, 0.2]) == pytest.approx([0.5 * 10 / 6, 0.125, 0.125])  # non-increasing
    assert calibration.apply([0.9]) == [1.0]  # clipped


def test_an_under_confident_head_is_corrected_by_what_gets_accepted():
    # 4 sequences, 10 ms + 4 ms per token, drafter 4 ms. The head says 0.3 for every first draft: a draft
    # costs 4 ms and the step commits ~0.13 tokens per ms, so 0.3 does not pay for it -> no drafts verified
    cost = FixedStepCost(base_s=0.010, per_token_s=0.004, draft_s=0.004)
    policy = CostAwareWidths(CostPolicyConfig(min_calibration_drafts=0, explore_new_requests=False),
                             cost)  # the head trusted at once
    ids = ["a", "b", "c", "d"]
    assert policy.choose_widths([(0.3,)] * 4, 4, ids) == [0, 0, 0, 0]
    assert policy.should_draft(4, 4) is False
    # probes explore whole blocks; every probed draft is accepted: the calibrated survival approaches 1
    for _ in range(6):
        policy._explore_next = True  # what a probe step sets
        assert policy.choose_widths([(0.3,)] * 4, 4, ids) == [1, 1, 1, 1]
        policy.observe_acceptance([RequestEvent(r, (5, 6), num_draft_tokens=1, num_accepted_drafts=1) for r in ids])
    assert policy.calibration.factor(0) > 2.5
    assert policy.choose_widths([(0.3,)] * 4, 4, ids) == [1, 1, 1, 1]
    assert policy.stats()["spec_policy_calibration"][0] == pytest.approx(policy.calibration.factor(0))


def test_an_uncalibrated_head_gets_whole_blocks_verified_first():
    # the head says 0.3 / 0.1 / 0.05: trusted, not even a first draft pays (as above). By default the
    # policy drafts and verifies whole blocks until every slot was checked min_calibration_drafts times;
    # after that the calibrated curve decides again
    cost = FixedStepCost(base_s=0.010, per_token_s=0.004, draft_s=0.004)
    policy = CostAwareWidths(CostPolicyConfig(min_calibration_drafts=8), cost)
    ids, head = ["a", "b", "c", "d"], (0.3, 0.33, 0.5)
    trusted = CostAwareWidths(CostPolicyConfig(min_calibration_drafts=0, explore_new_requests=False), cost)
    assert trusted.choose_widths([head] * 4, 4, ids) == [0, 0, 0, 0]
    for _ in range(2):  # 4 requests a step: every slot verified 8 times
        assert policy.should_draft(4, 4) is True
        assert policy.choose_widths([head] * 4, 4, ids) == [3, 3, 3, 3]
        policy.observe_acceptance([RequestEvent(r, (5, 6, 7, 8), num_draft_tokens=3, num_accepted_drafts=3)
                                   for r in ids])
    assert policy.calibration.covers(3, 8) and not policy.calibration.covers(3, 9)
    assert policy.counters.num_skipped_steps == 0 and policy.counters.num_cut_drafts == 0
    assert policy.calibration.factor(0) > 1.5 and policy._calibrated()  # what the objective now works from


def _verify_one(policy, request_id, head, accepted: bool) -> int:
    """One cycle of one request: the width the policy verifies, then all or none of it accepted."""
    (width,) = policy.choose_widths([head], 1, [request_id])
    if width:
        policy.observe_acceptance([RequestEvent(request_id, tuple(range(width + 1)), num_draft_tokens=width,
                                                num_accepted_drafts=width if accepted else 0)])
    return width


def test_each_request_is_judged_by_its_own_drafts():
    # one request composes (none of its drafts survive), the next one recites (all do), the same head for both
    cost = FixedStepCost(base_s=0.010, per_token_s=0.004, draft_s=0.004)
    policy = CostAwareWidths(CostPolicyConfig(min_calibration_drafts=0), cost)
    head = (0.6, 0.6, 0.6)
    widths = [_verify_one(policy, "compose", head, accepted=False) for _ in range(5)]
    assert widths[0] == 3 and widths[-1] == 0  # its first block whole (exploration), then cut: they die
    assert policy.should_draft(1, 1, ["compose"]) is False
    assert policy.should_draft(1, 1, ["recite"]) is True  # a request not yet seen gets drafts to show
    assert _verify_one(policy, "recite", head, accepted=True) == 3  # whole, although the global evidence is bad
    assert _verify_one(policy, "recite", head, accepted=True) == 3  # its own accepted drafts make them pay
    policy.forget("recite")
    assert policy.should_draft(1, 1, ["recite"]) is True  # a finished request's evidence goes with it


class _OverlongDrafter(Drafter):
    """Answers 7 drafts whatever it was asked (a broken or mismatched drafter)."""

    async def __call__(self, request):
        self.requests.append(request)
        return DraftTokens(step_id=request.step_id, proposals=tuple(
            DraftProposal(slot.request_id, tuple(range(50, 57)), (0.5,) * 7, (0.99,) * 7) for slot in request.slots))


@pytest.mark.parametrize("policy", list(WidthPolicyKind))
def test_the_router_never_verifies_more_drafts_than_it_asked_for(policy):
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, max_model_len=512))
    drafts = DraftCoordinator(DraftConfig(max_draft_tokens=5, width_policy=policy), _OverlongDrafter(),
                              cost=FixedStepCost(base_s=0.020, per_token_s=0.0))
    asyncio.run(drafts.after_step(scheduler, _decoding(scheduler)))
    assert _scheduled_drafts(scheduler) == {"a": 5, "b": 5, "c": 5}  # the block size, not 7


def test_a_long_run_of_plain_steps_sends_features_only_before_a_probe():
    cost = FixedStepCost(base_s=0.020, per_token_s=0.001, draft_s=0.200)  # drafting never pays
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, max_model_len=512))
    drafter = Drafter()
    config = DraftConfig(max_draft_tokens=5, width_policy=WidthPolicyKind.COST,
                         cost_policy=CostPolicyConfig(probe_every_steps=4, max_probe_every_steps=16,
                                                      feature_warmup_steps=3, min_calibration_drafts=0))
    drafts = DraftCoordinator(config, drafter, cost=cost)
    translator = PlanTranslator()
    asyncio.run(drafts.after_step(scheduler, _decoding(scheduler)))
    features, asked = [], []
    for _ in range(30):
        output = scheduler.schedule()
        plan = drafts.decorate(translator.plans_for(output)[-1])
        features.append(all(seq.send_features for seq in plan.sequences))
        assert len({seq.send_features for seq in plan.sequences}) == 1
        events = scheduler.update(output, {seq.request_id: SequenceResult((9,)) for seq in output.scheduled})
        before = len(drafter.requests)
        asyncio.run(drafts.after_step(scheduler, events))
        asked.append(len(drafter.requests) > before)
    assert [index for index, was_asked in enumerate(asked) if was_asked] == [4, 13]  # probe intervals 4, 8, (16)
    # features while deciding and on the verify step after a probe, then only within 3 steps of the next
    # probe: a ring with gaps, its newest positions complete when the drafter is asked again
    on, off = True, False
    assert features == [on] * 6 + [off] * 4 + [on] * 5 + [off] * 12 + [on] * 3
    assert drafts.stats()["spec_policy_num_steps_without_features"] == 16
