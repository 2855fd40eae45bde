"""How many drafted tokens each request sends to verification (dspark.md §2.4, §4.2, §6.2).

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

Pure Python: no torch, so the router can validate `--speculation` without loading it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
