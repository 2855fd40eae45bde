"""How many drafted tokens each request sends to verification (docs/speculation.md §2.4, §6.2).

Three modes (`moemesh serve --speculation off|fixed|adaptive [--spec-width N]`):
- off: no drafts; the drafter is not consulted.
- fixed: every request verifies `width` drafts (fewer only where the router's budget cuts them).
- adaptive: per request, keep the longest prefix of the block whose prefix survival
  S_k = c_1 · … · c_k (the confidence head's conditional acceptance estimates) stays at or above
  `survival_threshold`, never more than `width` and never fewer than `min_width`.

The verify width never exceeds the drafter's block size γ (`dspark_block_size`): the drafter
makes exactly γ slots per pass, and asking for more collapsed acceptance on other stacks
(nst = 7 on a γ = 5 checkpoint gave 1.31 accepted tokens instead of 2.74). A configuration
asking for more is refused when it is built, before any process starts serving.

The cost-aware part of adaptive mode (below `choose_width`): `cost_aware_widths` picks, for a
whole batch, how many of the confidence rule's drafts each request verifies so that the expected
committed tokens per second of the step are highest (docs/speculation.md §2.4); `drafting_pays` says whether
asking the drafter at all beats a plain step. The router runs them with the step costs it learns
(services/router/spec_policy.py); fixed mode never goes through them.

Pure Python: no torch, so the router can validate `--speculation` without loading it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_SURVIVAL_THRESHOLD = 0.3


class SpeculationError(ValueError):
    """A speculation setting that cannot be served; the message names the setting."""


class SpeculationMode(StrEnum):
    OFF = "off"
    FIXED = "fixed"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class SpeculationConfig:
    """mode; width: the drafts per request in fixed mode, the cap in adaptive mode (None with
    mode off); survival_threshold in (0, 1): adaptive mode's stop rule; min_width: adaptive
    mode's floor (a single draft costs the verifier almost nothing, so the default is 1).

    Invariants (checked here, without the model): off has no width; fixed and adaptive have
    1 <= min_width <= width. `validate_block_size` adds width <= γ once the checkpoint is known;
    `for_model` builds a fully validated config from command-line values.
    """

    mode: SpeculationMode
    width: int | None = None
    survival_threshold: float = DEFAULT_SURVIVAL_THRESHOLD
    min_width: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.mode, SpeculationMode):
            raise SpeculationError(f"--speculation {self.mode!r}: choose one of "
                                   f"{', '.join(mode.value for mode in SpeculationMode)}")
        if not (0.0 < self.survival_threshold < 1.0) or math.isnan(self.survival_threshold):
            raise SpeculationError(f"survival threshold {self.survival_threshold}: must be in (0, 1)")
        if self.mode is SpeculationMode.OFF:
            if self.width is not None:
                raise SpeculationError(f"--spec-width {self.width} given with --speculation off")
            return
        if self.width is None or self.width < 1:
            raise SpeculationError(f"--spec-width {self.width}: speculation {self.mode.value} needs a width >= 1")
        if not 1 <= self.min_width <= self.width:
            raise SpeculationError(f"min width {self.min_width}: must be in [1, --spec-width {self.width}]")

    @property
    def enabled(self) -> bool:
        return self.mode is not SpeculationMode.OFF

    def validate_block_size(self, block_size: int | None) -> "SpeculationConfig":
        """Refuse a width the drafter cannot produce. block_size None: the checkpoint has no
        drafter, so only `off` is possible. Returns self for chaining."""
        if not self.enabled:
            return self
        if block_size is None:
            raise SpeculationError(f"--speculation {self.mode.value}: the checkpoint has no DSpark drafter "
                                   "(no dspark_block_size in config.json); use --speculation off")
        if self.width is not None and self.width > block_size:
            raise SpeculationError(
                f"--spec-width {self.width} exceeds the drafter's block size (dspark_block_size = {block_size}): "
                f"the drafter proposes at most {block_size} tokens per step; use --spec-width {block_size} or less")
        return self

    @classmethod
    def for_model(cls, mode: SpeculationMode | str | None, width: int | None, block_size: int | None, *,
                  survival_threshold: float = DEFAULT_SURVIVAL_THRESHOLD) -> "SpeculationConfig":
        """The serve-time config. mode None: adaptive when the checkpoint has a drafter
        (block_size not None), off otherwise. width None: the block size (fixed / adaptive)."""
        if mode is None:
            mode = SpeculationMode.ADAPTIVE if block_size is not None else SpeculationMode.OFF
        try:
            mode = SpeculationMode(mode)
        except ValueError:
            raise SpeculationError(f"--speculation {mode!r}: choose one of "
                                   f"{', '.join(m.value for m in SpeculationMode)}") from None
        if mode is not SpeculationMode.OFF and width is None:
            if block_size is None:
                cls(mode, 1, survival_threshold).validate_block_size(None)  # raises the no-drafter message
            width = block_size
        return cls(mode, width, survival_threshold).validate_block_size(block_size)


def prefix_survival(confidences: Sequence[float]) -> list[float]:
    """S_k = Π_{j<=k} c_j for each k (same order as the block's slots)."""
    survival, product = [], 1.0
    for confidence in confidences:
        product *= float(confidence)
        survival.append(product)
    return survival


def choose_width(confidences: Sequence[float], config: SpeculationConfig) -> int:
    """The number of leading drafts of one block to verify.

    confidences: c_1..c_G of the block's slots (G = the drafted slots available). Off: 0.
    Fixed: min(width, G). Adaptive: the longest prefix with S_k >= survival_threshold, clamped
    to [min_width, width] and to G.
    """
    num_available = len(confidences)
    if not config.enabled or num_available == 0:
        return 0
    if config.mode is SpeculationMode.FIXED:
        return min(config.width, num_available)
    num_kept = 0
    for survival in prefix_survival(confidences):
        if survival < config.survival_threshold:
            break
        num_kept += 1
    return min(max(num_kept, config.min_width), config.width, num_available)


# -- the cost-aware part of adaptive mode (DSpark's hardware-aware scheduler, docs/speculation.md §2.4) -------------
#
# The confidence rule above caps each request's block; the router then picks, for the whole batch,
# how many of those capped drafts to verify. A draft at slot k of request r is committed with
# probability S_rk (its prefix survival; the confidence head's estimate), and the step always commits
# one token per request (the bonus or the replacement). So a step that verifies widths w_r commits
# in expectation E(w) = Σ_r (1 + Σ_{k <= w_r} S_rk) tokens, and takes cycle_s(K) seconds for
# K = Σ_r w_r drafts (attention step of base + K tokens, the drafter's round trip, the router's rest).
# The policy maximises the batch's expected committed tokens per second E(w) / cycle_s(K).
# For a given K the best widths take the K candidates with the highest survival over all requests
# (S is non-increasing along a block, so the K best form a prefix of every block); the policy
# evaluates every K from 0 to all candidates and keeps the best (the smallest K on ties).
# With a cycle time that does not grow with K (free verification) every candidate with S > 0 pays,
# so the widths equal the caps: the confidence rule alone.


@dataclass(frozen=True)
class WidthChoice:
    """The batch's widths (one per request, in input order), the expected committed tokens of the
    step (bonus included) and its predicted cycle time."""

    widths: tuple[int, ...]
    expected_tokens: float
    cycle_s: float

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.widths)

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.cycle_s if self.cycle_s > 0 else math.inf


def survival_curve(confidences: Sequence[float]) -> list[float]:
    """Prefix survival with each confidence clipped to [0, 1] (NaN: 0), so the curve is non-increasing:
    a broken head must not make a later slot look likelier than an earlier one."""
    clipped = [0.0 if math.isnan(c) else min(max(float(c), 0.0), 1.0) for c in confidences]
    return prefix_survival(clipped)


def expected_committed_tokens(survivals: Sequence[Sequence[float]], widths: Sequence[int]) -> float:
    """E(w) = Σ_r (1 + Σ_{k <= w_r} S_rk): one bonus / replacement per request plus each verified
    draft's survival probability."""
    if len(survivals) != len(widths):
        raise ValueError(f"{len(survivals)} survival curves for {len(widths)} widths")
    total = 0.0
    for curve, width in zip(survivals, widths):
        if not 0 <= width <= len(curve):
            raise ValueError(f"width {width} outside [0, {len(curve)}]")
        total += 1.0 + sum(curve[:width])
    return total


def cost_aware_widths(survivals: Sequence[Sequence[float]], cycle_s: Callable[[int], float]) -> WidthChoice:
    """Widths maximising expected committed tokens per second for one batch.

    survivals[r]: request r's non-increasing prefix survivals S_r1..S_rm, m = its cap (the
    confidence rule's or fixed width, never above the block size), so no width exceeds its cap.
    cycle_s(K): predicted seconds of the engine cycle that verifies K drafts in all, > 0.
    Deterministic: candidates are ordered by (-S, slot, request index) and ties keep the smaller K.
    """
    candidates = sorted((-float(s), slot, index) for index, curve in enumerate(survivals)
                        for slot, s in enumerate(curve))
    num_requests = len(survivals)
    best_k, best_tokens, best_cycle_s = 0, float(num_requests), _checked_cycle_s(cycle_s, 0)
    tokens = float(num_requests)
    for k, (negative_survival, _slot, _index) in enumerate(candidates, start=1):
        tokens -= negative_survival
        candidate_cycle_s = _checked_cycle_s(cycle_s, k)
        # tokens / cycle > best_tokens / best_cycle, cross-multiplied (cycles are > 0); relative margin on ties
        if tokens * best_cycle_s > best_tokens * candidate_cycle_s * (1.0 + 1e-12):
            best_k, best_tokens, best_cycle_s = k, tokens, candidate_cycle_s
    widths = [0] * num_requests
    for _negative_survival, _slot, index in candidates[:best_k]:
        widths[index] += 1
    return WidthChoice(tuple(widths), best_tokens, best_cycle_s)


def _checked_cycle_s(cycle_s: Callable[[int], float], num_draft_tokens: int) -> float:
    value = float(cycle_s(num_draft_tokens))
    if not value > 0 or math.isinf(value):
        raise ValueError(f"cycle_s({num_draft_tokens}) = {value}: must be a finite time > 0")
    return value


def drafting_pays(survivals: Sequence[Sequence[float]], cycle_s: Callable[[int], float],
                  plain_cycle_s: float) -> bool:
    """Whether asking the drafter is expected to beat a plain step: the best widths for these
    survival curves (one per request of the step, empty for a request without drafts; cycle_s
    includes the drafter's round trip) against len(survivals) tokens in `plain_cycle_s` (no drafter)."""
    if not plain_cycle_s > 0:
        raise ValueError(f"plain_cycle_s = {plain_cycle_s}: must be > 0")
    choice = cost_aware_widths(survivals, cycle_s)
    return choice.num_draft_tokens > 0 and choice.tokens_per_s > len(survivals) / plain_cycle_s
