"""Control channel messages between the router and the draft worker.

Part of the wire vocabulary registered in `common/wire/messages.py` (see its docstring for the
field types the codec understands); imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class DraftSlot:
    """What the drafter should propose for one request after `step_id`.

    `last_token_ids` are the request's newest tokens at positions `start_position ...`; the
    last of them is the seed (anchor), so the seed position is
    `start_position + len(last_token_ids) - 1` and draft slot k predicts the token at the seed
    position + 1 + k. `num_draft_tokens` caps the drafts wanted (the drafter's width policy may
    return fewer). Sampled requests (temperature > 0) need `seed` and
    `first_output_position`, the output position (tokens generated so far) of draft slot 0:
    the drafter's random streams are keyed by it, like the verifier's.
    """

    request_id: str
    num_draft_tokens: int
    last_token_ids: tuple[int, ...]
    start_position: int
    temperature: float = 0.0
    seed: int | None = None
    first_output_position: int | None = None


@dataclass(frozen=True)
class DraftRequest:
    TYPE: ClassVar[str] = "draft_request"
    step_id: int
    slots: tuple[DraftSlot, ...]
    finished_request_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class DraftProposal:
    """Drafts for one request: `draft_probs[i]` is q(token_ids[i]) under the drafter,
    `confidences[i]` the drafter's own acceptance estimate; all three have one length.

    Sampled requests also carry the exact distribution each draft was drawn from, sparse:
    slot i's q is `support_probs[i][j]` at token `support_token_ids[i][j]` and exactly 0
    elsewhere (the drafter samples from that sparse distribution itself, so rejection
    sampling against it is lossless). Empty for greedy requests.
    """

    request_id: str
    token_ids: tuple[int, ...]
    draft_probs: tuple[float, ...]
    confidences: tuple[float, ...]
    support_token_ids: tuple[tuple[int, ...], ...] = ()
    support_probs: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True)
class DraftTokens:
    """Draft worker -> router / attention worker."""

    TYPE: ClassVar[str] = "draft_tokens"
    step_id: int
    proposals: tuple[DraftProposal, ...]
