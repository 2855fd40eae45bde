"""The drafter inside the attention worker's process (`[draft] placement = "attention"`).

The draft worker's proposer (common/drafting/proposer.py) runs here, so nothing about drafting
changes but the transport: `DraftProposer.add_features` takes each step's committed target features
straight from the runner's capture (no TargetFeatures message, no Ack), and right after the step
`DraftProposer.propose` drafts the next block of every sequence whose plan entry asks for it
(`ScheduledSequence.draft_after`), from the token the step just sampled. The proposals travel back
in the step's own SequenceResults (`next_drafts`). One speculative cycle is then one router round
trip; with the draft worker in a process of its own it is three messages more (features and their
Ack, DraftRequest, DraftTokens) and a second round trip on the critical path, which on one host
costs more than it buys (docs/speculation.md, "Where the drafter runs").

A draft that fails here is logged and the sequence gets none: verification is lossless whatever the
drafts, so outputs never depend on it. Rings of sequences whose slot is freed are dropped.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import structlog

from moemesh.common.wire.messages import DraftProposal, DraftRequest, DraftSlot, TargetFeatures
from moemesh.common.drafting.proposer import DrafterConfig, DraftProposer, DraftSlotError

log = structlog.get_logger("attention")


@dataclass(frozen=True)
class NextDraftAsk:
    """One sequence the step asked drafts for, after its verification: `seed_token_id` (the newest
    sampled token) sits at `seed_position`; `num_outputs` tokens were generated so far."""

    request_id: str
    num_draft_tokens: int
    seed_token_id: int
    seed_position: int
    num_outputs: int
    temperature: float = 0.0
    seed: int | None = None


class LocalDrafter:
    """A loaded DraftProposer used in-process: `send` has the FeatureSender interface (the worker's
    feature path is the same in both placements), `propose_next` drafts after a step."""

    def __init__(self, config: DrafterConfig, on_progress=None) -> None:
        self.proposer = DraftProposer(config)
        self.proposer.load_now(on_progress=on_progress)
        drafter = self.proposer.drafter
        self.config = config
        self.num_failures = 0
        self._step_ids = 0
        log.info("attention.drafter_in_process", name=config.name, device=str(self.proposer.device),
                 block_size=drafter.dspark.block_size, mode=self.proposer.speculation.mode.value,
                 width=self.proposer.speculation.width)

    @property
    def block_size(self) -> int:
        return self.proposer.drafter.dspark.block_size

    def send(self, message: TargetFeatures) -> bool:
        try:
            self.proposer.add_features(message)
        except ValueError as error:  # a capture that does not fit the drafter: no drafts from stale rings
            self.num_failures += 1
            log.error("attention.features_not_added", step_id=message.step_id, error=str(error)[:200])
            return False
        return True

    def propose_next(self, asks: list[NextDraftAsk]) -> dict[str, DraftProposal]:
        """The next block of every ask (empty proposals left out)."""
        if not asks:
            return {}
        self._step_ids += 1
        slots = tuple(DraftSlot(request_id=ask.request_id, num_draft_tokens=ask.num_draft_tokens,
                                last_token_ids=(ask.seed_token_id,), start_position=ask.seed_position,
                                temperature=ask.temperature,
                                seed=ask.seed if ask.temperature > 0 else None,
                                first_output_position=ask.num_outputs if ask.temperature > 0 else None)
                      for ask in asks)
        try:
            reply = self.proposer.propose(DraftRequest(step_id=self._step_ids, slots=slots))
        except (DraftSlotError, ValueError, RuntimeError) as error:
            self.num_failures += 1
            log.error("attention.draft_failed", error=str(error)[:300], num_failures=self.num_failures,
                      action="this step's sequences go on without drafts")
            return {}
        return {p.request_id: p for p in reply.proposals if p.token_ids}

    def propose_after_step(self, work, results: dict) -> float:
        """The next block of every sequence of the step whose plan entry asks for it (`draft_after`), put into
        its SequenceResult in `results` (by request id). work: the step's items (`.scheduled`, `.slot`).
        Returns the seconds it took."""
        started_s = time.perf_counter()
        asks = []
        for item in work:
            scheduled = item.scheduled
            result = results.get(scheduled.request_id)
            if scheduled.draft_after < 1 or result is None or result.error is not None or not result.token_ids:
                continue
            params = item.slot.params
            sampled = params is not None and not params.is_greedy
            if sampled and scheduled.draft_seed is None:
                continue  # a sampled request's drafts need their own seed: none asked, none drafted
            asks.append(NextDraftAsk(
                request_id=scheduled.request_id, num_draft_tokens=min(scheduled.draft_after, self.block_size),
                seed_token_id=result.token_ids[-1],
                seed_position=seed_position_after(scheduled.start_position, len(scheduled.token_ids),
                                                  len(scheduled.draft_token_ids), result.num_draft_accepted),
                num_outputs=len(item.slot.output_token_ids), temperature=params.temperature if sampled else 0.0,
                seed=scheduled.draft_seed if sampled else None))
        if not asks:
            return 0.0
        for request_id, proposal in self.propose_next(asks).items():
            results[request_id] = dataclasses.replace(results[request_id], next_drafts=proposal)
        return time.perf_counter() - started_s

    def drop(self, request_ids) -> None:
        for request_id in request_ids:
            self.proposer.rings.drop(request_id)

    def close(self) -> None:
        log.info("attention.drafter_summary", num_failures=self.num_failures, **self.proposer.timings.as_log_fields())


def seed_position_after(start_position: int, num_tokens: int, num_drafts: int, num_accepted: int) -> int:
    """Where a sequence's newest sampled token sits after a step that computed `num_tokens` tokens
    from `start_position`, `num_drafts` of them drafts of which `num_accepted` were kept."""
    return start_position + num_tokens - (num_drafts - num_accepted)
