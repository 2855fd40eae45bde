"""The DSpark draft worker service: a `DraftProposer` (common/drafting/proposer.py) behind a socket
(docs/design.md §2 step 7), for `[draft] placement = "process"`.

Messages (`handle`):
- `TargetFeatures` (from the attention worker after each step): `add_features`, answered with Ack
  (the attention worker waits for it, so the features are in the ring before the router, which acts
  on the StepResult, can ask for the next block);
- `DraftRequest` (from the router): `propose`, answered with DraftTokens (ErrorReply MALFORMED for
  a slot it cannot serve).
"""

from __future__ import annotations

from typing import Any

import structlog

from moemesh.common.drafting.proposer import DrafterConfig, DraftProposer, DraftSlotError
from moemesh.common.runtime.service import Service
from moemesh.common.wire.messages import Ack, DraftRequest, ErrorCode, ErrorReply, TargetFeatures

log = structlog.get_logger("draft")


class DraftWorker(DraftProposer, Service):
    accepts = (TargetFeatures, DraftRequest)

    def __init__(self, config: DrafterConfig, drafter=None) -> None:
        DraftProposer.__init__(self, config, drafter)

    async def load(self) -> None:
        if self.drafter is None:
            self.load_now(on_progress=self.load_progress)
        from moemesh.common.checkpoint.side_loading import WeightBytes, drafter_resident_bytes

        self.weight_bytes = WeightBytes(resident=drafter_resident_bytes(self.drafter),
                                        stored=getattr(self.drafter, "stored_weight_bytes", 0))
        self.report_weight_bytes(self.device, self.weight_bytes.resident, self.weight_bytes.stored)
        log.info("draft.loaded", block_size=self.drafter.dspark.block_size, mode=self.speculation.mode.value,
                 width=self.speculation.width, device=str(self.device),
                 resident_weight_bytes=self.weight_bytes.resident, stored_weight_bytes=self.weight_bytes.stored)

    async def handle(self, message: Any) -> Any:
        match message:
            case TargetFeatures():
                self.add_features(message)
                return Ack()
            case DraftRequest():
                try:
                    return self.propose(message)
                except DraftSlotError as error:
                    return ErrorReply(code=ErrorCode.MALFORMED, message=str(error), request_id=error.request_id)
        return await super().handle(message)

    async def close(self) -> None:
        log.info("draft.timing_summary", **self.timings.as_log_fields())

    def num_inflight(self) -> int:
        return self.num_live_requests()


__all__ = ["DraftWorker"]
