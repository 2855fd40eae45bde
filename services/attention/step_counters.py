"""What a step costs the attention worker's host: ZeroMQ messages per layer and synchronising CUDA calls.

`StepCounting.count(plan, run)` runs one step and returns its result with `StepCounters` attached:
- data messages: the expert channel's Dispatch / DispatchSlot sends during the step (a layer's work going
  over ZeroMQ); the step plan and result, and a mailbox offer, are not counted;
- host syncs, with `MOEMESH_COUNT_HOST_SYNCS=1` on a CUDA worker: torch's sync debug mode is on while the
  step runs, and every warning it raises (a stream or device synchronize, a blocking device-to-host copy,
  `.item()`, `.tolist()`, `nonzero`) is counted and swallowed; off by default, since each warning costs
  host time. A step with none per layer shows a constant count per step (the read of the sampled tokens).
The router adds them up for decode steps (`/status.json` `decode_step_counters`) and `moemesh bench serve`
reports them per step and per layer.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable

import torch

from moemesh.common.wire.messages import StepCounters, StepPlan, StepResult

COUNT_HOST_SYNCS_ENV = "MOEMESH_COUNT_HOST_SYNCS"
_SYNC_WARNING = "called a synchronizing CUDA operation"


def is_decode_plan(plan: StepPlan) -> bool:
    """Every sequence computes one new token (plus the drafts it verifies)."""
    return bool(plan.sequences) and all(len(s.token_ids) - len(s.draft_token_ids) == 1 for s in plan.sequences)


class StepCounting:
    def __init__(self, channel, device: torch.device, num_layers: int, count_host_syncs: bool | None = None) -> None:
        """count_host_syncs None: from MOEMESH_COUNT_HOST_SYNCS (only on CUDA)."""
        if count_host_syncs is None:
            count_host_syncs = os.environ.get(COUNT_HOST_SYNCS_ENV, "0") not in ("", "0")
        self.channel = channel
        self.num_layers = num_layers
        self.count_host_syncs = bool(count_host_syncs) and torch.device(device).type == "cuda"

    def count(self, plan: StepPlan, run: Callable[[StepPlan], StepResult]) -> StepResult:
        sent_before = self.channel.num_layer_messages if self.channel is not None else 0
        host_syncs = -1
        if self.count_host_syncs:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = run(plan)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            host_syncs = 0
            for warning in caught:
                if _SYNC_WARNING in str(warning.message):
                    host_syncs += 1
                else:  # not ours to swallow
                    warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        else:
            result = run(plan)
        sent = (self.channel.num_layer_messages if self.channel is not None else 0) - sent_before
        counters = StepCounters(decode=is_decode_plan(plan), num_layers=self.num_layers, data_messages=sent,
                                host_syncs=host_syncs)
        return dataclasses.replace(result, counters=counters)
