"""The routed part of one MoE layer for one micro-batch: split by owner, send, later combine.

`start` sends each expert worker only the tokens that have at least one slot it owns, with a
slot mask saying which; it returns a `PendingMoE` ticket at once. `finish` waits for the
answers and combines them in a fixed order:
- partial-sum mode: routed = 0 + partial(worker 0) + partial(worker 1) + ... (ascending worker
  index). Each partial already adds its slots in slot order, so with K = 2 (one slot per worker
  at most twice) the result is bit-identical to the single-process sum; with K > 2 spread over
  several workers the association differs and results agree to rounding only.
- placement-invariant mode: workers return per-slot outputs [T, K, D]; they are scattered into
  one [T, K, D] tensor and the K slots are added in slot order (= ascending expert id), the
  reference's exact order, whatever the placement.
Received outputs go to the attention device through a `RecvStagingRing`: on a CUDA device each
lands in a pinned slot and is copied up asynchronously (the slot is reused only after its copy
finished); on the CPU the received frame is used as it is. An output larger than a slot (rare:
placement-invariant prefill beyond the slot size) is copied up synchronously instead.
Replicas: with R owner tables (see `set_owner_tables`) each `start` uses the next one in turn.
Legend: T tokens, K top-k slots, D hidden, W expert workers, L layers, E routed experts, R tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.wire.staging import RecvStagingRing

from common.model.moe import sum_slots_in_order
from common.wire.messages import Combine, Dispatch, ErrorReply
from services.attention.expert_channel import ExpertChannel


class DispatchError(RuntimeError):
    """An expert worker answered a Dispatch with an error (or with a Combine that does not match)."""


@dataclass
class _Sent:
    worker_index: int
    ticket: int
    token_index: torch.Tensor  # [T_w] rows of the micro-batch sent to this worker
    slot_mask: torch.Tensor  # [T_w, K] bool
    dispatch_id: int


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


class MoEDispatcher:
    def __init__(self, channel: ExpertChannel, owner_table: list[list[int]], *, placement_invariant: bool,
                 device: torch.device, num_recv_slots: int = 4, recv_slot_bytes: int = 32 << 20) -> None:
        self.channel = channel
        self.device = device
        self.set_owner_tables([owner_table])
        self.placement_invariant = placement_invariant
        self.recv_ring = RecvStagingRing(str(device), num_slots=num_recv_slots, slot_bytes=recv_slot_bytes)
        self.recv_slot_bytes = recv_slot_bytes
        self.num_unstaged_receives = 0
        self._dispatch_ids = 0

    def set_owner_tables(self, owner_tables: list[list[list[int]]]) -> None:
        """Replace the routing table (between steps only: nothing may be in flight). R >= 1 tables
        [L, E]; with replicas they differ in the pairs held twice, and successive `start` calls
        take them in turn (round robin), so replicas share an expert's load."""
        self.owners = torch.tensor(owner_tables, dtype=torch.long, device=self.device)  # [R, L, E] worker index
        self.owner = self.owners[0]  # [L, E] the primary table
        self._turn = 0

    def start(self, step_id: int, micro_batch: int, layer: int, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> PendingMoE:
        """x [T, D], ids [T, K], weights [T, K] -> a ticket; every Dispatch is sent before returning."""
        table = self.owners[self._turn % self.owners.shape[0]]  # [L, E]
        self._turn += 1
        owner = table[layer][ids]  # [T, K]
        workers = torch.unique(owner).tolist()  # ascending; one host sync per layer and micro-batch
        sent = []
        for worker_index in workers:
            mask = owner == worker_index  # [T, K]
            token_index = mask.any(dim=1).nonzero().squeeze(1)  # [T_w]
            slot_mask = mask[token_index]
            self._dispatch_ids += 1
            dispatch = Dispatch(
                dispatch_id=self._dispatch_ids, step_id=step_id, layer=layer, micro_batch=micro_batch,
                hidden=x[token_index].contiguous(), expert_ids=ids[token_index].to(torch.int32).contiguous(),
                weights=weights[token_index].float().contiguous(), per_expert_outputs=self.placement_invariant,
                slot_mask=slot_mask.contiguous(),
            )
            ticket = self.channel.send(worker_index, dispatch)
            sent.append(_Sent(worker_index, ticket, token_index, slot_mask, self._dispatch_ids))
        return PendingMoE(layer, micro_batch, x.shape[0], ids.shape[1], x.shape[1], x.dtype, x.device, sent)

    def finish(self, pending: PendingMoE) -> torch.Tensor:
        """Wait for every answer of `pending` -> routed output [T, D], combined in the fixed order."""
        if self.placement_invariant:
            per_slot = torch.zeros(pending.num_tokens, pending.num_slots, pending.hidden_size, dtype=pending.dtype,
                                   device=pending.device)  # [T, K, D]
        else:
            routed = torch.zeros(pending.num_tokens, pending.hidden_size, dtype=pending.dtype, device=pending.device)
        for sent in pending.sent:  # ascending worker index
            output = self._to_device(self._answer(pending, sent)).to(pending.dtype)
            if self.placement_invariant:  # [T_w, K, D]: take only our slots from this worker
                rows = per_slot[sent.token_index]
                per_slot[sent.token_index] = torch.where(sent.slot_mask[..., None], output, rows)
            else:  # [T_w, D]
                routed[sent.token_index] += output
        return sum_slots_in_order(per_slot) if self.placement_invariant else routed

    def _to_device(self, received: torch.Tensor) -> torch.Tensor:
        """A received (read-only, host) tensor on the attention device, through the landing ring."""
        if received.numel() * received.element_size() > self.recv_slot_bytes:
            self.num_unstaged_receives += 1
            return received.to(self.recv_ring.device)
        return self.recv_ring.to_device(received)

    def _answer(self, pending: PendingMoE, sent: _Sent) -> torch.Tensor:
        reply = self.channel.receive(sent.worker_index, sent.ticket)
        if isinstance(reply, ErrorReply):
            raise DispatchError(f"expert worker {sent.worker_index}, layer {pending.layer}: {reply.code}: "
                                f"{reply.message}")
        if not isinstance(reply, Combine) or reply.dispatch_id != sent.dispatch_id or reply.layer != pending.layer:
            raise DispatchError(f"expert worker {sent.worker_index} answered dispatch {sent.dispatch_id} with "
                                f"{type(reply).__name__} {getattr(reply, 'dispatch_id', None)}")
        expected = ((len(sent.token_index), pending.num_slots, pending.hidden_size) if self.placement_invariant
                    else (len(sent.token_index), pending.hidden_size))
        if tuple(reply.output.shape) != expected:
            raise DispatchError(f"combine output {tuple(reply.output.shape)}, expected {expected}")
        return reply.output
