"""The router's cost-aware width policy for adaptive speculation (docs/speculation.md §2.4).

The drafter applies the confidence rule (each block cut where its prefix survival drops below the
threshold, `common/speculation_width.py: choose_width`). On top of that, with `WidthPolicyKind.COST`,
the router decides per engine cycle, for the whole batch:

1. whether to ask the drafter at all (`should_draft`): a drafter round trip is paid whatever the
   widths, so when even the best widths for the recent survival curve would commit fewer tokens
   per second than a plain step (`width.drafting_pays`), the router skips the DraftRequest and the
   step runs plain. It still asks after `probe_every_steps` skipped steps (doubling while probes
   keep finding that drafting does not pay, up to `max_probe_every_steps`), so the survival curve
   and the drafter's cost stay current. In such a run the attention worker sends target features
   only for the `feature_warmup_steps` steps before a probe (`wants_features`): the drafter's ring
   allows gaps, and the sends are most of what a plain step of a speculating server costs extra;
2. how many of the proposed drafts each request verifies (`choose_widths`):
   `width.cost_aware_widths` over the proposals' survival curves, with the cycle time
   t_attention(N + K) + drafter round trip + router rest from the cost model. Possibly 0.

While the cost model does not know any line (fewer than a few decode steps, or only one token
count seen), the policy explores: it keeps the drafter's widths (the confidence rule), or verifies
none when the bucket has only seen drafted steps, so the line gets its second point. A probe step
explores too (whole blocks), so the line keeps a spread of token counts while plain steps dominate.

Calibration: the head's survival S_k is scaled per slot by accepted / predicted over the drafts
verified so far (`AcceptanceCalibration`, fed by `observe_acceptance` from the step's events), so a
head that is over- or under-confident on this model and workload does not bias the decisions.

`WidthPolicyKind.DRAFTER` keeps the drafter's widths always: fixed mode stays fixed, and the
confidence rule alone can be served for comparison.

Deterministic given a deterministic cost model (`spec_cost.FixedStepCost`), the same proposals and
the same verification results.
Never wider than a proposal (so never above the block size). Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from moemesh.common.speculation_width import cost_aware_widths, drafting_pays, survival_curve
from moemesh.services.router.spec_cost import OnlineStepCost, StepCostModel


class WidthPolicyKind(StrEnum):
    DRAFTER = "drafter"  # verify what the drafter proposed (fixed mode; or the confidence rule alone)
    COST = "cost"  # adaptive: also weigh each draft's survival against what it adds to the cycle time


@dataclass(frozen=True)
class CostPolicyConfig:
    """probe_every_steps: while drafting does not pay, ask the drafter anyway after this many
    plain steps; each probe that still finds drafting not paying doubles the interval, up to
    max_probe_every_steps (a probe costs a drafter round trip), and drafting that pays resets it;
    survival_decay: weight of the older survival curve per drafted step (0..1);
    feature_warmup_steps: in a run of plain steps, the attention worker sends the drafter target
    features only for the last this-many steps before a probe (sending them costs ~5 ms a step
    on an H200; the drafter's ring allows gaps, its context is then these positions);
    min_calibration_drafts: until every slot of the block has been verified this many times, the
    head's survival is not trusted: the policy drafts and verifies whole blocks (a head that
    underrates its later slots would otherwise never have them verified, and so never corrected);
    explore_new_requests: a request's first block is drafted and verified whole, so that its own
    calibration (what its drafts survive, against the head) starts from evidence of its own."""

    probe_every_steps: int = 8
    max_probe_every_steps: int = 64
    survival_decay: float = 0.7
    feature_warmup_steps: int = 16
    min_calibration_drafts: int = 16
    explore_new_requests: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.probe_every_steps <= self.max_probe_every_steps:
            raise ValueError(f"probe intervals must satisfy 1 <= {self.probe_every_steps} <= "
                             f"{self.max_probe_every_steps}")
        if not 0.0 <= self.survival_decay < 1.0:
            raise ValueError(f"survival_decay must be in [0, 1), got {self.survival_decay}")
        if self.feature_warmup_steps < 1:
            raise ValueError(f"feature_warmup_steps must be >= 1, got {self.feature_warmup_steps}")
        if self.min_calibration_drafts < 0:
            raise ValueError(f"min_calibration_drafts must be >= 0, got {self.min_calibration_drafts}")


@dataclass
class AcceptanceCalibration:
    """Per draft slot k, the verified drafts' acceptances against the survival the head predicted
    for them (exponentially weighted), as a factor on the head's survival: an over- or under-confident
    confidence head would otherwise make the policy draft when it does not pay, or skip when it
    would. prior_weight pulls the factor towards 1 while little has been verified."""

    decay: float = 0.98
    prior_weight: float = 2.0
    predicted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    num_verified: list[int] = field(default_factory=list)  # drafts verified per slot, ever

    def add(self, predicted_survival: Sequence[float], num_accepted: int) -> None:
        """One verify step of one request: the survivals of the drafts it verified, and how many
        of them were accepted (draft k is accepted iff k < num_accepted)."""
        for k, survival in enumerate(predicted_survival):
            if k == len(self.predicted):
                self.predicted.append(0.0)
                self.accepted.append(0.0)
                self.num_verified.append(0)
            self.predicted[k] = self.decay * self.predicted[k] + survival
            self.accepted[k] = self.decay * self.accepted[k] + (1.0 if k < num_accepted else 0.0)
            self.num_verified[k] += 1

    def covers(self, num_slots: int, min_drafts: int) -> bool:
        """Every one of the first num_slots slots has been verified at least min_drafts times."""
        return all((self.num_verified[k] if k < len(self.num_verified) else 0) >= min_drafts for k in range(num_slots))

    def factor(self, k: int, prior: float = 1.0) -> float:
        """accepted / predicted at slot k, pulled towards `prior` while little was verified."""
        if k >= len(self.predicted):
            return prior
        return (self.accepted[k] + self.prior_weight * prior) / (self.predicted[k] + self.prior_weight)

    def apply(self, survival: Sequence[float], priors: Sequence[float] = ()) -> list[float]:
        """The calibrated curve: each S_k times its slot's factor (towards priors[k], else 1), clipped to
        [0, 1], non-increasing."""
        curve, previous = [], 1.0
        for k, value in enumerate(survival):
            previous = min(previous, max(0.0, value * self.factor(k, priors[k] if k < len(priors) else 1.0)))
            curve.append(previous)
        return curve


@dataclass
class PolicyCounters:
    num_skipped_steps: int = 0  # DraftRequests not sent: drafting was not expected to pay
    num_probe_steps: int = 0  # DraftRequests sent only to refresh the estimates
    num_explore_steps: int = 0  # widths chosen to learn the cost line, not by the objective
    num_proposed_drafts: int = 0  # drafts the drafter returned
    num_cut_drafts: int = 0  # of those, not verified because they did not pay
    num_steps_without_features: int = 0  # plain steps far from a probe: no target features sent

    def as_stats(self) -> dict[str, int]:
        return {f"spec_policy_{name}": value for name, value in vars(self).items()}


class CostAwareWidths:
    def __init__(self, config: CostPolicyConfig = CostPolicyConfig(), cost: StepCostModel | None = None) -> None:
        self.config = config
        self.cost: StepCostModel = cost if cost is not None else OnlineStepCost()
        self.counters = PolicyCounters()
        self._mean_survival: list[float] | None = None
        self._num_plain_steps = 0  # consecutive skipped steps
        self._probe_interval = config.probe_every_steps
        self._last_step_end_s: float | None = None
        self._draft_s_since_step = 0.0
        self._explore_next = False  # a probe: verify the drafter's whole blocks (fresh cost and acceptance data)
        self.calibration = AcceptanceCalibration()
        # per request, its own verified drafts with the global factors as the prior: text a request recites
        # and text it composes survive very differently, and one request's drafts say most about its next
        self._request_calibration: dict[str, AcceptanceCalibration] = {}
        self._explored: set[str] = set()  # requests whose first block was verified whole (explore_new_requests)
        self._verified: dict[str, list[float]] = {}  # request id -> predicted survival of the drafts it verifies

    # -- observations ------------------------------------------------------------------------
    def observe_step(self, scheduled: Sequence[Any], attention_s: float, now_s: float) -> None:
        """One finished attention step (its ScheduledSequences). Decode steps feed the cost line;
        the time since the previous step, less this step and the drafter, is the router's rest."""
        if scheduled and all(not seq.is_new_sequence and len(seq.token_ids) == 1 + len(seq.draft_token_ids)
                             for seq in scheduled):
            self.cost.observe_attention(len(scheduled), sum(len(seq.token_ids) for seq in scheduled), attention_s)
        if self._last_step_end_s is not None:
            busy_s = attention_s + self._draft_s_since_step
            other_s = now_s - self._last_step_end_s - busy_s
            if 0.0 <= other_s <= busy_s:  # longer: the loop was idle between steps, not working
                self.cost.observe_other(other_s)
        self._last_step_end_s = now_s
        self._draft_s_since_step = 0.0

    def observe_draft(self, num_drafted: int, seconds: float) -> None:
        self.cost.observe_draft(num_drafted, seconds)
        self._draft_s_since_step += seconds

    def observe_acceptance(self, events: Sequence[Any]) -> None:
        """A step's RequestEvents: how many of each request's verified drafts were accepted."""
        for event in events:
            predicted = self._verified.pop(event.request_id, None)
            if predicted is not None and event.num_draft_tokens:
                self.calibration.add(predicted[:event.num_draft_tokens], event.num_accepted_drafts)
                own = self._request_calibration.setdefault(event.request_id, AcceptanceCalibration(prior_weight=1.0))
                own.add(predicted[:event.num_draft_tokens], event.num_accepted_drafts)

    def wants_features(self) -> bool:
        """Whether the next step should send the drafter its target features: yes while drafting
        (or deciding), and in a run of plain steps only within feature_warmup_steps of the probe."""
        if self._num_plain_steps == 0 or \
                self._probe_interval - self._num_plain_steps <= self.config.feature_warmup_steps:
            return True
        self.counters.num_steps_without_features += 1
        return False

    def forget(self, request_id: str) -> None:
        """A finished or aborted request: drop what was kept for its calibration."""
        self._verified.pop(request_id, None)
        self._request_calibration.pop(request_id, None)
        self._explored.discard(request_id)

    # -- decisions ---------------------------------------------------------------------------
    def should_draft(self, num_sequences: int, num_drafted: int, request_ids: Sequence[str] | None = None) -> bool:
        """Whether to draft this cycle for num_drafted of the num_sequences requests (request_ids: those
        num_drafted, to use what each one's own drafts showed; a request whose first block was not verified
        yet is drafted for, see explore_new_requests)."""
        if num_drafted == 0:
            return False
        line = self.cost.attention_line(num_sequences)
        draft_s = self.cost.draft_round_trip_s(num_drafted)
        unseen = self.config.explore_new_requests and request_ids is not None and \
            any(r not in self._explored for r in request_ids)
        if line is None or draft_s is None or self._mean_survival is None or not self._calibrated() or unseen:
            self._num_plain_steps = 0  # drafting again: features on every step (wants_features)
            return True  # not known yet: draft, and learn
        if drafting_pays(self._survivals_like_mean(num_sequences, num_drafted, request_ids),
                         self._cycle_s(line, num_sequences, draft_s), self._plain_cycle_s(line, num_sequences)):
            self._num_plain_steps = 0
            self._probe_interval = self.config.probe_every_steps
            return True
        if self._num_plain_steps >= self._probe_interval:
            self._num_plain_steps = 0
            self._probe_interval = min(2 * self._probe_interval, self.config.max_probe_every_steps)
            self.counters.num_probe_steps += 1
            self._explore_next = True
            return True
        self._num_plain_steps += 1
        self.counters.num_skipped_steps += 1
        return False

    def choose_widths(self, confidences: Sequence[Sequence[float]], num_sequences: int,
                      request_ids: Sequence[str] | None = None) -> list[int]:
        """Widths for the proposals (confidences[r]: the drafter's kept slots of request r, already
        cut by its own rule); num_sequences: the next step's sequences; request_ids (same order):
        to calibrate the head against what verification then accepts (observe_acceptance). The
        drafter's round trip is the cost model's (observe_draft has just fed it this one). Each
        width is <= its proposal's length. After a probe (and while the cost line is unknown) the
        policy explores: whole blocks, or none once the bucket has only seen drafted steps."""
        raw = [survival_curve(c) for c in confidences]
        self._update_survival(raw)
        ids = list(request_ids) if request_ids is not None else [None] * len(raw)
        curves = [self._calibrated_curve(request_id, curve) for request_id, curve in zip(ids, raw)]
        caps = [len(curve) for curve in curves]
        self.counters.num_proposed_drafts += sum(caps)
        line = self.cost.attention_line(num_sequences)
        draft_s = self.cost.draft_round_trip_s(len(curves)) or 0.0
        if line is None or self._explore_next or not self._calibrated():
            self.counters.num_explore_steps += 1
            seen_tokens = getattr(self.cost, "mean_tokens", lambda _: None)(num_sequences)
            explore_plain = line is None and seen_tokens is not None and seen_tokens > num_sequences + 0.5
            widths = [0] * len(caps) if explore_plain else caps
        else:
            widths = list(cost_aware_widths(curves, self._cycle_s(line, num_sequences, draft_s)).widths)
            if self.config.explore_new_requests:  # a request's first block is verified whole: its own evidence
                widths = [cap if request_id is not None and request_id not in self._explored else width
                          for request_id, cap, width in zip(ids, caps, widths)]
        self._explored.update(request_id for request_id, width in zip(ids, widths) if request_id is not None and width)
        self._explore_next = False
        if request_ids is not None:
            for request_id, curve, width in zip(request_ids, raw, widths):
                if width:
                    self._verified[request_id] = curve[:width]
        self.counters.num_cut_drafts += sum(caps) - sum(widths)
        return widths

    # -- helpers -----------------------------------------------------------------------------
    def _calibrated(self) -> bool:
        """The head's survival has been checked against verification at every slot it offers."""
        num_slots = len(self._mean_survival or [])
        return self.calibration.covers(num_slots, self.config.min_calibration_drafts)

    def _cycle_s(self, line: tuple[float, float], num_sequences: int, draft_s: float):
        base_s, per_token_s = line
        fixed_s = max(base_s + per_token_s * num_sequences, 1e-6) + draft_s + self.cost.other_s()
        return lambda num_draft_tokens: fixed_s + per_token_s * num_draft_tokens

    def _plain_cycle_s(self, line: tuple[float, float], num_sequences: int) -> float:
        base_s, per_token_s = line
        return max(base_s + per_token_s * num_sequences, 1e-6) + self.cost.other_s()

    def _calibrated_curve(self, request_id: str | None, survival: Sequence[float]) -> list[float]:
        """The head's survival calibrated by the request's own verified drafts, with the global
        calibration as their prior (the global one alone for a request not yet verified)."""
        own = self._request_calibration.get(request_id) if request_id is not None else None
        if own is None:
            return self.calibration.apply(survival)
        return own.apply(survival, [self.calibration.factor(k) for k in range(len(survival))])

    def _survivals_like_mean(self, num_sequences: int, num_drafted: int,
                             request_ids: Sequence[str] | None = None) -> list[list[float]]:
        mean = self._mean_survival or []
        if request_ids is None:
            curves = [self.calibration.apply(mean)] * num_drafted
        else:
            curves = [self._calibrated_curve(request_id, mean) for request_id in request_ids]
        return [list(curve) for curve in curves] + [[]] * max(0, num_sequences - len(curves))

    def _update_survival(self, curves: list[list[float]]) -> None:
        """Per slot, the mean over this step's proposals of S_k (0 past a proposal's end: those
        slots were not offered), blended into the running curve."""
        if not curves:
            return
        length = max(len(curve) for curve in curves)
        if length == 0:
            return
        mean = [sum(curve[k] if k < len(curve) else 0.0 for curve in curves) / len(curves) for k in range(length)]
        old, decay = self._mean_survival, self.config.survival_decay
        if old is not None:
            old = old + [0.0] * (length - len(old))
            mean = mean + [0.0] * (len(old) - length)
            mean = [decay * a + (1.0 - decay) * b for a, b in zip(old, mean)]
        self._mean_survival = mean

    def stats(self) -> dict:
        summary = getattr(self.cost, "summary", None)
        return {**self.counters.as_stats(),
                "spec_policy_mean_survival": list(self._mean_survival or []),
                "spec_policy_calibration": [self.calibration.factor(k)
                                            for k in range(len(self.calibration.predicted))],
                **({"spec_cost_model": summary()} if summary is not None else {})}
