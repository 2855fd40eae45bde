"""What a speculative engine cycle costs, learned online by the router (docs/speculation.md §2.4).

One engine cycle = the attention step (plan sent .. StepResult) + the drafter's round trip
(DraftRequest .. DraftTokens; none when the router does not ask) + the router's rest (update,
publish, schedule). The width policy (`common/speculation_width.py: cost_aware_widths`) needs the
cycle time as a function of the drafts it verifies, so this module keeps:

- per batch-composition bucket (the number of sequences in the step, rounded up to a power of
  two: 1, 2, 4, 8, ...), a line t_attention(N) = a + b·N over the step's token count N, fitted
  by least squares through the median time at each token count (its last 8 steps), on decode
  steps only (every sequence computes its seed plus its drafts; prefill chunks would mix another
  cost curve in);
- per bucket, the median of the drafter's last 15 round trips (none before 3: the first one may
  carry a first CUDA call of a second);
- the median of the router's rest per cycle over the last 31 cycles.

Medians, not means: one slow step (a cold start, another process on the host) would otherwise
tilt the decisions for many steps, and a policy that stops drafting gets no new drafter timings
to wash a bad one out.
A line needs two distinct token counts in its bucket; until it has one, the nearest bucket's line
stands in, and with no line anywhere `attention_line` is None and the policy explores (see
services/router/spec_policy.py). Slopes are clamped at >= 0 and the
line's value at >= 0: noise (other processes on the host, MPS ordering on a GPU) can tilt a fit
the wrong way, and a negative marginal cost would make the policy draft without limit.

`FixedStepCost` is the deterministic model for tests and for a measured profile: the same
interface, observations ignored. Plain Python: the router never imports torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Protocol


class StepCostModel(Protocol):
    def attention_line(self, num_sequences: int) -> tuple[float, float] | None:
        """(intercept_s, per_token_s) of t_attention(N) for a step of num_sequences; None: unknown."""

    def draft_round_trip_s(self, num_drafted: int) -> float | None:
        """The drafter's round trip for num_drafted requests; None: unknown."""

    def other_s(self) -> float:
        """The router's own time per cycle (>= 0)."""

    def observe_attention(self, num_sequences: int, num_tokens: int, seconds: float) -> None: ...

    def observe_draft(self, num_drafted: int, seconds: float) -> None: ...

    def observe_other(self, seconds: float) -> None: ...


def bucket_of(num_sequences: int) -> int:
    """The batch-composition bucket: num_sequences rounded up to a power of two (1, 2, 4, 8, ...)."""
    if num_sequences < 1:
        raise ValueError(f"num_sequences must be >= 1, got {num_sequences}")
    return 1 << (num_sequences - 1).bit_length()


@dataclass(frozen=True)
class FixedStepCost:
    """t_attention(N) = base_s + per_token_s · N whatever the bucket; a constant drafter round trip
    and router rest. Ignores observations, so a policy built on it is deterministic."""

    base_s: float
    per_token_s: float
    draft_s: float = 0.0
    router_s: float = 0.0

    def __post_init__(self) -> None:
        if self.base_s <= 0 or min(self.per_token_s, self.draft_s, self.router_s) < 0:
            raise ValueError(f"FixedStepCost needs base_s > 0 and the other terms >= 0: {self}")

    def attention_line(self, num_sequences: int) -> tuple[float, float]:
        return self.base_s, self.per_token_s

    def draft_round_trip_s(self, num_drafted: int) -> float:
        return self.draft_s

    def other_s(self) -> float:
        return self.router_s

    def observe_attention(self, num_sequences: int, num_tokens: int, seconds: float) -> None:
        pass

    def observe_draft(self, num_drafted: int, seconds: float) -> None:
        pass

    def observe_other(self, seconds: float) -> None:
        pass


@dataclass
class MedianLine:
    """A line y = a + b·x through the medians of y at each distinct x (its last `per_x` values),
    least squares weighted by how many values each median has. Medians shrug off the odd slow step
    (a first CUDA call, another process on the host), which a mean would carry for many steps; an
    x not seen in the last `max_age` observations is forgotten, so the line follows drift."""

    per_x: int = 8
    max_age: int = 256
    num_observations: int = 0
    _ys: dict[int, deque] = field(default_factory=dict)
    _last_seen: dict[int, int] = field(default_factory=dict)

    def add(self, x: int, y: float) -> None:
        self.num_observations += 1
        self._ys.setdefault(x, deque(maxlen=self.per_x)).append(y)
        self._last_seen[x] = self.num_observations
        for stale in [x for x, seen in self._last_seen.items() if self.num_observations - seen >= self.max_age]:
            del self._ys[stale], self._last_seen[stale]

    def _points(self) -> list[tuple[int, float, int]]:
        return [(x, median(ys), len(ys)) for x, ys in self._ys.items()]

    def mean_x(self) -> float | None:
        points = self._points()
        if not points:
            return None
        return sum(x * w for x, _, w in points) / sum(w for _, _, w in points)

    def fit(self, min_spread: float) -> tuple[float, float] | None:
        """(intercept, slope >= 0), or None while sqrt(Σ w (x - x̄)²) is below min_spread: the slope's
        uncertainty goes with 1 / Σ w (x - x̄)² (one token count seen: not identified at all)."""
        points = self._points()
        weight = sum(w for _, _, w in points)
        if weight == 0:
            return None
        mean_x = sum(x * w for x, _, w in points) / weight
        mean_y = sum(y * w for _, y, w in points) / weight
        sxx = sum(w * (x - mean_x) ** 2 for x, _, w in points)
        if sxx < min_spread * min_spread:
            return None
        slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / sxx)
        return mean_y - slope * mean_x, slope


@dataclass
class RecentMedian:
    """The median of the last `maxlen` values; None until `min_count` arrived (a first value alone
    may be a cold start)."""

    maxlen: int = 15
    min_count: int = 3
    _values: deque = field(init=False)

    def __post_init__(self) -> None:
        self._values = deque(maxlen=self.maxlen)

    def add(self, value: float) -> None:
        self._values.append(value)

    def value(self) -> float | None:
        return median(self._values) if len(self._values) >= self.min_count else None


def _nearest_first(buckets, own: int) -> list[int]:
    """The buckets ordered by distance (in powers of two) from `own`, the smaller first on a tie."""
    return sorted(buckets, key=lambda b: (abs(b.bit_length() - own.bit_length()), b))


@dataclass
class OnlineStepCost:
    """The engine's own timings, per bucket (see the module docstring).

    min_observations: decode steps a bucket needs before its line is used; min_token_spread:
    sqrt(Σ w (N - N̄)²) over their token counts N that the slope needs (MedianLine.fit)."""

    min_observations: int = 3
    min_token_spread: float = 1.0
    _lines: dict[int, MedianLine] = field(default_factory=dict)
    _drafts: dict[int, RecentMedian] = field(default_factory=dict)
    _other: RecentMedian = field(default_factory=lambda: RecentMedian(maxlen=31, min_count=1))

    def attention_line(self, num_sequences: int) -> tuple[float, float] | None:
        """The bucket's own line; while it has none, the line of the nearest bucket that has one
        (the smaller on a tie: a batch shrinking as requests finish should not explore again)."""
        for bucket in _nearest_first(self._lines, bucket_of(num_sequences)):
            line = self._lines[bucket]
            fit = line.fit(self.min_token_spread) if line.num_observations >= self.min_observations else None
            if fit is not None:
                return fit
        return None

    def mean_tokens(self, num_sequences: int) -> float | None:
        """The weighted mean token count seen in the bucket (exploration aims away from it)."""
        line = self._lines.get(bucket_of(num_sequences))
        return None if line is None else line.mean_x()

    def draft_round_trip_s(self, num_drafted: int) -> float | None:
        """The bucket's median round trip; while it has none, the nearest bucket's (as for lines)."""
        for bucket in _nearest_first(self._drafts, bucket_of(max(1, num_drafted))):
            value = self._drafts[bucket].value()
            if value is not None:
                return value
        return None

    def other_s(self) -> float:
        return self._other.value() or 0.0

    def observe_attention(self, num_sequences: int, num_tokens: int, seconds: float) -> None:
        self._lines.setdefault(bucket_of(num_sequences), MedianLine()).add(num_tokens, seconds)

    def observe_draft(self, num_drafted: int, seconds: float) -> None:
        self._drafts.setdefault(bucket_of(max(1, num_drafted)), RecentMedian()).add(seconds)

    def observe_other(self, seconds: float) -> None:
        self._other.add(max(0.0, seconds))

    def summary(self) -> dict:
        """Per bucket: the fitted line (ms, ms per token), the drafter's round trip (ms); for /status.json."""
        buckets = {}
        for bucket in sorted(set(self._lines) | set(self._drafts)):
            line = self._lines.get(bucket)
            fit = line.fit(self.min_token_spread) if line is not None else None
            draft = self._drafts.get(bucket)
            draft_s = draft.value() if draft is not None else None
            buckets[str(bucket)] = {
                "num_steps": line.num_observations if line is not None else 0,
                "attention_base_ms": None if fit is None else 1e3 * fit[0],
                "attention_ms_per_token": None if fit is None else 1e3 * fit[1],
                "draft_round_trip_ms": None if draft_s is None else 1e3 * draft_s}
        return {"buckets": buckets, "router_other_ms": 1e3 * self.other_s()}
