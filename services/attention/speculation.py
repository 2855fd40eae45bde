"""Speculation on the attention worker's side: the target features the drafter conditions on.

Drafts are verified in the normal step (draft_verification.py). The drafter conditions on the stream-averaged
hidden states after the `dspark_target_layer_ids` layers (`ModelRunner.capture_layer_ids` keeps them per
micro-batch).
Choice: the attention worker sends them itself, straight to the draft worker
(`TargetFeatures`, waiting for its Ack) before it answers the StepResult, so the features are
in the drafter's ring before the router, which only acts on the StepResult, asks for the next
block. The router relaying them instead would put tensors through the torch-free router and
cost a second hop. Only committed positions are sent (rejected drafts never), and of a long
chunk only its last `sliding_window` positions (the drafter's ring keeps no more).
A failed send is logged and the step goes on: drafts then see an older context, which lowers
acceptance but never changes outputs (verification is lossless whatever the drafts).
Legend: T tokens, D hidden, L capture layers, N rows sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch

from moemesh.common.model.config import ModelConfig
from moemesh.common.wire.messages import FeatureSegment, TargetFeatures

log = structlog.get_logger("attention")


def capture_layer_ids(config: ModelConfig) -> tuple[int, ...]:
    """The target layers whose outputs feed the drafter (() without a drafter). The runner
    captures in layer order, so the ids must ascend (concatenation order = config order)."""
    if config.dspark is None:
        return ()
    layer_ids = tuple(config.dspark.target_layer_ids)
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"dspark_target_layer_ids {layer_ids}: expected strictly ascending layer ids")
    return layer_ids


def attach_feature_sender(worker, sender) -> None:
    """Make a loaded AttentionWorker capture the drafter's target layers and hand its
    TargetFeatures to `sender` (anything with send(TargetFeatures) -> bool and close()).
    The worker does this itself with a `FeatureSender` when it has a draft endpoint; this is the
    same wiring for a drafter reached another way (in-process tests and tools)."""
    layer_ids = capture_layer_ids(worker.side.config)
    if not layer_ids:
        raise ValueError("the model has no DSpark drafter (no dspark_target_layer_ids)")
    worker.runner.capture_layer_ids = frozenset(layer_ids)
    worker.feature_sender = sender


@dataclass(frozen=True)
class CommittedRows:
    """Of one sequence's chunk in its micro-batch: rows first_row ..< first_row + num_rows
    are committed tokens at positions start_position ..."""

    request_id: str
    micro_batch: int
    first_row: int
    num_rows: int
    start_position: int
    token_ids: tuple[int, ...]


def committed_rows(request_id: str, micro_batch: int, chunk_offset: int, token_ids: tuple[int, ...],
                   start_position: int, num_rejected: int, max_positions: int) -> CommittedRows | None:
    """The rows worth sending: committed (no rejected draft) and within the newest
    max_positions (the drafter's ring size). None when nothing is left."""
    num_committed = len(token_ids) - num_rejected
    skip = max(0, num_committed - max_positions)
    if num_committed - skip <= 0:
        return None
    return CommittedRows(request_id, micro_batch, chunk_offset + skip, num_committed - skip, start_position + skip,
                         tuple(token_ids[skip:num_committed]))


def target_features_message(step_id: int, rows: list[CommittedRows], captured: list[list[torch.Tensor]],
                            to_host: bool = True) -> TargetFeatures:
    """captured[i]: micro-batch i's [T_i, D] per capture layer -> one TargetFeatures [N, L·D] (on the host for
    the wire; to_host=False: left on the capture's device, for a drafter in this process)."""
    pieces, segments, num_rows = [], [], 0
    for entry in rows:
        layers = captured[entry.micro_batch]
        piece = torch.cat([h[entry.first_row:entry.first_row + entry.num_rows] for h in layers], dim=-1)  # [n, L·D]
        pieces.append(piece)
        segments.append(FeatureSegment(entry.request_id, num_rows, entry.num_rows, entry.start_position,
                                       entry.token_ids))
        num_rows += entry.num_rows
    features = torch.cat(pieces)  # [N, L·D]
    features = features.to("cpu").contiguous() if to_host else features
    return TargetFeatures(step_id=step_id, segments=tuple(segments), features=features)


class FeatureSender:
    """Sends TargetFeatures to the draft worker and waits for its Ack (ordering, see module doc)."""

    def __init__(self, endpoint: str, context, timeout_s: float) -> None:
        from moemesh.common.wire.transport import SyncClient

        self.endpoint = endpoint
        self.client = SyncClient(endpoint, context=context, default_timeout_s=timeout_s)
        self.num_failures = 0
        self.num_sent = 0
        self.send_s_total = 0.0  # send .. Ack, summed: the step time features cost

    def send(self, message: TargetFeatures) -> bool:
        from moemesh.common.wire.errors import ReplyTimeout, WireError
        from moemesh.common.wire.messages import Ack

        started_s = time.perf_counter()
        try:
            reply = self.client.request(message)
        except (ReplyTimeout, WireError) as error:
            reply = error
        self.send_s_total += time.perf_counter() - started_s
        if isinstance(reply, Ack):
            self.num_sent += 1
            return True
        self.num_failures += 1
        log.warning("attention.features_not_delivered", step_id=message.step_id, endpoint=self.endpoint,
                    reply=str(reply)[:200], num_failures=self.num_failures)
        return False

    def close(self) -> None:
        log.info("attention.feature_send_summary", num_sent=self.num_sent, num_failures=self.num_failures,
                 send_ms_mean=1e3 * self.send_s_total / max(1, self.num_sent + self.num_failures))
        self.client.close()
