"""The drafter's command-line options, shared by `moemesh draft` and `moemesh attention` (whose
in-process drafter takes the same ones), and the block size a checkpoint announces. Imports no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moemesh.common.speculation_width import DEFAULT_SURVIVAL_THRESHOLD, SpeculationMode

DEFAULT_MAX_SUPPORT = 64  # tokens kept in a sampled draft's proposal distribution
# how a sampled request's drafts are chosen (proposer.py): "greedy" drafts the drafter's argmax, a proposal
# distribution with all its mass on that token; "sampled" draws them from the drafter's top-support softmax
DRAFT_SAMPLING_CHOICES = ("greedy", "sampled")
DEFAULT_DRAFT_SAMPLING = "greedy"


@dataclass(frozen=True)
class DraftOptions:
    """Command-line choices; mode / width None take the model's defaults (SpeculationConfig.for_model)."""

    mode: SpeculationMode | None = None
    width: int | None = None
    survival_threshold: float = DEFAULT_SURVIVAL_THRESHOLD
    max_support: int | None = DEFAULT_MAX_SUPPORT
    draft_sampling: str = DEFAULT_DRAFT_SAMPLING


def add_draft_arguments(parser) -> None:
    parser.add_argument("--speculation", choices=[mode.value for mode in SpeculationMode], default=None,
                        help="off, fixed or adaptive (default: adaptive when the checkpoint has a drafter)")
    parser.add_argument("--spec-width", type=int, default=None,
                        help="drafts per request (fixed) or their cap (adaptive); at most dspark_block_size")
    parser.add_argument("--spec-survival-threshold", type=float, default=DEFAULT_SURVIVAL_THRESHOLD,
                        help="adaptive mode stops where the cumulative survival probability drops below this")
    parser.add_argument("--draft-support", type=int, default=DEFAULT_MAX_SUPPORT,
                        help="tokens kept in a sampled draft's proposal distribution (0: full vocabulary)")
    parser.add_argument("--draft-sampling", choices=DRAFT_SAMPLING_CHOICES, default=DEFAULT_DRAFT_SAMPLING,
                        help="a sampled request's drafts: greedy (the drafter's argmax, verified as a proposal "
                             "with all its mass on it) or sampled (drawn from the drafter's top --draft-support "
                             "tokens at the request's temperature); both keep outputs distributed as the target's")


def options_from_args(args) -> DraftOptions:
    return DraftOptions(mode=SpeculationMode(args.speculation) if args.speculation else None, width=args.spec_width,
                        survival_threshold=args.spec_survival_threshold,
                        max_support=args.draft_support if args.draft_support and args.draft_support > 0 else None,
                        draft_sampling=args.draft_sampling)


def draft_block_size(model_dir: str | Path) -> int | None:
    """`dspark_block_size` of the checkpoint's config.json (read raw: no torch); None: no drafter."""
    with open(Path(model_dir) / "config.json", encoding="utf-8") as handle:
        value = json.load(handle).get("dspark_block_size")
    return int(value) if value else None
