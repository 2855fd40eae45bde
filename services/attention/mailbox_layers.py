"""Which MoE layers go through mailboxes, for `MoEDispatcher` with `data_plane = "mailbox"`.

A layer without replicas whose remote holders all accepted a mailbox (mailbox_plane.py: CPU expert workers of
this host, expert workers on this GPU) posts the whole micro-batch into each of their mailboxes; the dispatcher
computes its own share meanwhile, and `finish` waits on each worker's done word (no ZeroMQ message per layer;
the workers pick their slots from the owner table they were given). Here: the plane (made once the model's
shapes are known), the per-layer check (offering a mailbox to a holder without one), the posts, and the
whole-step check a step graph needs, worked out once per routing table and set of mailboxes.
Legend: T tokens, K top-k slots, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moemesh.services.attention.dispatch_tickets import _Sent
from moemesh.services.attention.layer_holders import LayerHolders
from moemesh.services.attention.mailbox_plane import MailboxConfig, MailboxPlane


class MailboxLayers:
    def __init__(self, channel, config: MailboxConfig, *, device: torch.device, placement_invariant: bool,
                 channel_prefix: str, on_lost: Callable[[int, str], Exception]) -> None:
        self.channel = channel
        self.config = config
        self.device = torch.device(device)
        self.placement_invariant = placement_invariant
        self.channel_prefix = channel_prefix
        self.on_lost = on_lost
        self.plane: MailboxPlane | None = None
        self._step_ready_token: tuple | None = None  # (router, version, plane generation) found step-ready

    def make_plane(self, hidden_size: int, top_k: int, dtype: torch.dtype) -> None:
        self.plane = MailboxPlane(self.channel, self.config, hidden_size=hidden_size, top_k=top_k, dtype=dtype,
                                  device=self.device, placement_invariant=self.placement_invariant,
                                  channel_prefix=self.channel_prefix, on_lost=self.on_lost)

    def begin_step(self, num_rows: int) -> None:
        if self.plane is not None:
            self.plane.begin_step(num_rows)

    def takes(self, layer: int, holders: LayerHolders, local_index: int | None, table_token: tuple) -> bool:
        """Whether every remote holder of `layer` (no replicas) has a mailbox, offering those without one.
        table_token: (router, version) of the routing table `holders` comes from."""
        if self.plane is None or holders.choice[layer]:
            return False
        remote = [w for w in holders.holders[layer] if w != local_index]
        return bool(remote) and all(self.plane.ready(w, table_token, holders.owned_pairs) for w in remote)

    def step_ready(self, num_tokens: int, holders: LayerHolders, local_index: int | None,
                   local_capturable: Callable[[], bool], table_token: tuple) -> bool:
        """Whether every layer's holders are this process (capturable kernels) or workers whose mailboxes carry
        `num_tokens` rows, on a CUDA waiting side (so one CUDA graph can hold the step)."""
        if self.device.type != "cuda" or self.plane is None or num_tokens > self.config.max_tokens:
            return False
        if self._step_ready_token == (*table_token, self.plane.generation):
            return True
        for layer, row in enumerate(holders.holders):
            if local_index in row and not local_capturable():
                return False
            if row != (local_index,) and not self.takes(layer, holders, local_index, table_token):
                return False
        self._step_ready_token = (*table_token, self.plane.generation)  # after the offers it made
        return True

    def post(self, layer: int, remote: list[int], x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             slot_owner: torch.Tensor | None, counts: list[int]) -> list[_Sent]:
        """The micro-batch (x [T, D], ids / weights [T, K]) into each remote holder's mailbox -> their tickets.
        slot_owner [T, K] (placement-invariant only): which worker each slot's output is taken from."""
        sent = []
        for worker_index in remote:
            seq = self.plane.post(worker_index, layer, x, ids, weights)
            mask = slot_owner == worker_index if self.placement_invariant else None  # [T, K]: its slots
            sent.append(_Sent(worker_index, seq, slice(None), mask, 0, counts[worker_index], mailbox=True))
        return sent
