"""What `MoEDispatcher` hands out and raises: the ticket of a started layer (`PendingMoE`, one `_Sent` per
worker it went to), a layer's routing read back to the host, and the errors recovery acts on.
Legend: T tokens, K top-k slots, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class DispatchError(RuntimeError):
    """An expert worker answered a Dispatch with an error (or with a Combine that does not match)."""


class ExpertWorkerLost(DispatchError):
    """One expert worker did not answer a Dispatch usably (timeout, error reply, wrong reply);
    `worker_index` is its channel index, so recovery can route around it."""

    def __init__(self, worker_index: int, endpoint: str, cause: str) -> None:
        super().__init__(f"expert worker {worker_index} ({endpoint}): {cause}")
        self.worker_index = worker_index
        self.endpoint = endpoint


@dataclass(frozen=True)
class HostRouting:
    """One layer's routing where `start` splits it (host under CUDA IPC, else device): ids, weights [T, K]."""

    ids: torch.Tensor
    weights: torch.Tensor


@dataclass
class _Sent:
    worker_index: int
    ticket: int
    token_index: torch.Tensor | slice  # [T_w] rows (on the attention device) sent to this worker (slice: all rows)
    slot_mask: torch.Tensor  # [T_w, K] bool, on the attention device where finish or the ring reads it, else host
    dispatch_id: int
    num_slot_tokens: int  # expert-slot pairs this worker computes (its share of the work)
    slot: int | None = None  # CUDA IPC ring slot holding this Dispatch (None: sent over ZeroMQ)
    local_output: torch.Tensor | None = None  # computed here (local experts): [T, D], or [T, K, D] per slot
    mailbox: bool = False  # posted into the worker's mailbox; ticket: the sequence number to collect


@dataclass
class PendingMoE:
    layer: int
    micro_batch: int
    num_tokens: int
    num_slots: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    sent: list[_Sent]
