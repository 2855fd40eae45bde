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
Host work of `start`: with CUDA IPC, one device->host read-back per layer and micro-batch
(`_routing_on_host`: ids and route weights in one transfer, the only host sync); owners, per-worker
counts, token rows and slot masks are then computed on the host and each worker's rows and mask go
up asynchronously. Over ZeroMQ the same split runs on the device (a read-back per count and per
worker's rows), see `start`.
Replicas and down workers: `slot_owners` (slot_owners.py) says which worker computes each slot: a
precomputed owner table where no expert of the layer has two live copies, else a copy per expert
picked by the `ReplicaRouter`, least outstanding work first (`num_slot_tokens_in_flight` per worker)
or in turn.
A worker that times out or refuses raises `ExpertWorkerLost` naming its channel index, so
recovery can mark it down and retry on the live replicas.
Local experts: pairs the placement gives the attention worker itself (local_experts.py) have a channel
index like any worker (endpoint `local:<name>`, no socket). `start` sends every remote worker's rows
first, then computes the local share in-process on the whole micro-batch with a device mask (device
work only), so it overlaps the remote workers; `finish` adds it at its index like any answer. A layer
held only here never leaves the device and needs no host sync; its answer is the per-slot outputs
[T, K, D], which ffn_post sums in slot order inside hc_post (no slot-sum launch of their own).
Mailboxes: with `data_plane=mailbox`, a layer whose remote holders all accepted a mailbox posts the whole
micro-batch into each (mailbox_layers.py), computes the local share meanwhile, and `finish` waits on each
worker's done word.
Data plane: with `data_plane=cuda_ipc` a Dispatch to a worker that mapped this attention worker's
device rings travels as a `DispatchSlot` (tensors in a shared device slot, ZeroMQ carries the control
message; dispatch_slots.py, common/wire/cuda_ipc.py); a layer held by a single worker then goes to it
whole without any host sync. Workers that refused (other host, CPU) stay on ZeroMQ.
Legend: T tokens, K top-k slots, D hidden, W expert workers, L layers, E routed experts, R tables.
"""

from __future__ import annotations


import torch

from moemesh.common.kernels.moe_layout import sum_slots_in_order
from moemesh.common.wire.cuda_ipc import CudaIpcConfig, DataPlane
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.messages import Combine, Dispatch, ErrorReply
from moemesh.common.wire.staging import RecvStagingRing
from moemesh.services.attention.dispatch_slots import SlotPlane
from moemesh.services.attention.dispatch_tickets import ExpertWorkerLost, HostRouting, PendingMoE, _Sent
from moemesh.services.attention.expert_channel import ExpertChannel, is_local_endpoint
from moemesh.services.attention.local_experts import LocalExperts
from moemesh.services.attention.mailbox_layers import MailboxLayers
from moemesh.services.attention.mailbox_plane import MailboxConfig, MailboxPlane
from moemesh.services.attention.replica_routing import ReplicaPolicy
from moemesh.services.attention.slot_owners import SlotOwners


class MoEDispatcher:
    def __init__(self, channel: ExpertChannel, owner_table: list[list[int]], *, placement_invariant: bool,
                 device: torch.device, num_recv_slots: int = 4, recv_slot_bytes: int = 32 << 20,
                 replica_policy: ReplicaPolicy = ReplicaPolicy.LEAST_LOADED,
                 data_plane: DataPlane = DataPlane.ZMQ, cuda_ipc: CudaIpcConfig = CudaIpcConfig(),
                 local_experts: LocalExperts | None = None, mailbox: MailboxConfig = MailboxConfig(),
                 channel_prefix: str = "attention", model_shape: tuple[int, int, torch.dtype] | None = None) -> None:
        """model_shape: (hidden size, top-k, activation dtype), to make the mailboxes at once (else at the
        first layer)."""
        self.channel = channel
        self.device = device
        self.local_experts = local_experts  # held in this process; channel index `local_index` (None: none)
        self.local_index = next((i for i, e in enumerate(channel.endpoints) if is_local_endpoint(e)), None)
        if (self.local_index is None) != (local_experts is None):
            raise ValueError("local experts need the channel's local endpoint, and it needs them")
        # CUDA IPC rings per worker (dispatch_slots.py), None: every Dispatch over ZeroMQ
        self.slot_plane = (SlotPlane(channel, cuda_ipc, device, placement_invariant=placement_invariant,
                                     on_lost=lambda w, cause: ExpertWorkerLost(w, channel.endpoints[w], cause))
                           if DataPlane(data_plane) is DataPlane.CUDA_IPC else None)
        # the mailboxes of expert workers on this host (mailbox_layers.py), None on another data plane
        self.mailboxes = (MailboxLayers(channel, mailbox, device=device, placement_invariant=placement_invariant,
                                        channel_prefix=channel_prefix,
                                        on_lost=lambda w, cause: ExpertWorkerLost(w, channel.endpoints[w], cause))
                          if DataPlane(data_plane) is DataPlane.MAILBOX else None)
        self.slot_owners = SlotOwners(owner_table, replica_policy, device)  # which worker computes each slot
        self.placement_invariant = placement_invariant
        self.recv_ring = RecvStagingRing(str(device), num_slots=num_recv_slots, slot_bytes=recv_slot_bytes)
        self.recv_slot_bytes = recv_slot_bytes
        self.num_unstaged_receives = 0
        self._dispatch_ids = 0
        self.num_slot_tokens_in_flight: list[int] = []  # per worker: sent, Combine not received yet
        self.num_slot_tokens_sent: list[int] = []  # per worker, cumulative (load-spread statistics)
        if self.mailboxes is not None and model_shape is not None:
            self.mailboxes.make_plane(*model_shape)

    def _grow_counters(self) -> None:
        """Per-worker counters for every worker the channel or the router names."""
        missing = max(self.channel.num_workers, self.slot_owners.num_workers()) - len(self.num_slot_tokens_in_flight)
        if missing > 0:
            self.num_slot_tokens_in_flight += [0] * missing
            self.num_slot_tokens_sent += [0] * missing

    def begin_step(self, num_rows: int) -> None:
        """The start of a step of `num_rows` rows in micro-batch 0 (before its first layer): the mailboxes' new
        epoch and GPU workers' doorbells (kernels on CUDA, so a captured step rings them too), early enough
        that a worker's graph is waiting when layer 0 posts."""
        if self.mailboxes is not None:
            self.mailboxes.begin_step(num_rows)

    def reset_in_flight(self) -> None:
        """Forget outstanding work (recovery dropped the tickets of a failed attempt)."""
        self.num_slot_tokens_in_flight = [0] * len(self.num_slot_tokens_in_flight)
        if self.slot_plane is not None:
            self.slot_plane.reset()

    def confirm_all(self, defer_mailboxes: bool = False) -> None:
        """Receive every deferred CUDA IPC reply (the end of a step); raises ExpertWorkerLost like finish.
        defer_mailboxes: the mailboxes' outcome is read by `confirm_deferred` after the step's own host sync
        (a replayed step graph: the host samples meanwhile; a failure then still fails the attempt)."""
        if self.slot_plane is not None:
            self.slot_plane.confirm_all()
        if self.mailbox_plane is not None:  # a CUDA waiting side's failed waits of this step
            self.mailbox_plane.confirm(defer=defer_mailboxes)

    def confirm_deferred(self) -> None:
        """Raise ExpertWorkerLost for a mailbox wait that failed in the step `confirm_all(defer_mailboxes=True)`
        ended (call after the step's sampled tokens were read, before anything leaves the worker)."""
        if self.mailbox_plane is not None:
            self.mailbox_plane.confirm_deferred()

    def _routing_on_host(self, ids: torch.Tensor, weights: torch.Tensor) -> HostRouting:
        """The layer's routing on the host in one device->host transfer: the only host sync of the CUDA
        IPC split (it waits for the layer's device work, as any read-back must)."""
        if ids.device.type != "cuda":
            return HostRouting(ids.long(), weights)
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (ids, weights)]
        for target, source in zip(pinned, (ids, weights)):
            target.copy_(source, non_blocking=True)
        torch.cuda.current_stream(ids.device).synchronize()
        return HostRouting(pinned[0].long(), pinned[1])

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the attention device without a host sync (pinned, asynchronous); a
        tensor already there as it is."""
        if self.device.type != "cuda" or host.device.type != "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def start(self, step_id: int, micro_batch: int, layer: int, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> PendingMoE:
        """x [T, D], ids [T, K], weights [T, K] -> a ticket; every Dispatch is sent before returning.
        One split for every transport: per worker (ascending) its token rows and slot mask, sent over its
        CUDA IPC ring if it has one, else over ZeroMQ. It runs on the host after one routing read-back with
        CUDA IPC (none when one worker holds the layer, `_start_whole`), on the device over ZeroMQ (measured
        full size: the host split made CUDA IPC steps faster, ZeroMQ ones slower); same rows, masks, order."""
        self._grow_counters()
        if self.mailboxes is not None and self.mailboxes.plane is None and layer == 0 and micro_batch == 0:
            self.mailboxes.make_plane(x.shape[1], ids.shape[1], x.dtype)  # no model shape was given
            self.mailboxes.begin_step(x.shape[0])  # the plane's first step begins here
        owners = self.slot_owners
        if self.local_index is not None and not owners.router.has_choice(layer) and \
                owners.layer_holders().sole(layer) == self.local_index:  # every expert of the layer is here
            sent = [self._compute_local(layer, x, ids, weights, None, ids.numel())]
            return PendingMoE(layer, micro_batch, x.shape[0], ids.shape[1], x.shape[1], x.dtype, x.device, sent)
        whole = self._start_whole(step_id, micro_batch, layer, x, ids, weights)
        if whole is None and self.mailboxes is not None:
            whole = self._start_mailboxes(micro_batch, layer, x, ids, weights)
            if whole is None and self.mailbox_plane is not None and micro_batch == 0:
                self.mailbox_plane.skip(layer, owners.layer_holders().holders[layer])  # GPU workers' graphs go on
        if whole is not None:
            return whole
        routing = HostRouting(ids, weights)
        if self.slot_plane is not None:
            if self.slot_plane.num_unconfirmed:
                self.slot_plane.confirm_all()  # the host sync below must not wait behind a dead worker's flag
            routing = self._routing_on_host(ids, weights)
        owner, slot_tokens = owners.of_slots(layer, routing.ids, self.num_slot_tokens_in_flight)  # [T, K]
        sent = []
        for worker_index, num_slot_tokens in slot_tokens.items():
            if worker_index == self.local_index:
                continue  # computed below, once every remote worker has its rows
            mask = owner == worker_index  # [T, K]
            token_index = mask.any(dim=1).nonzero().squeeze(1)  # [T_w]
            slot_mask = mask[token_index]  # [T_w, K]
            device_index = self._upload(token_index)  # finish adds the answer at these rows
            self._dispatch_ids += 1
            if self.slot_plane is not None:
                device_mask = self._upload(slot_mask)
                sent_slot = self.slot_plane.try_send(
                    worker_index, dispatch_id=self._dispatch_ids, step_id=step_id, layer=layer,
                    micro_batch=micro_batch, x=x[device_index], ids=ids[device_index], weights=weights[device_index],
                    slot_mask=device_mask)
                if sent_slot is not None:
                    self.num_slot_tokens_in_flight[worker_index] += num_slot_tokens
                    self.num_slot_tokens_sent[worker_index] += num_slot_tokens
                    sent.append(_Sent(worker_index, sent_slot[0], device_index, device_mask, self._dispatch_ids,
                                      num_slot_tokens, slot=sent_slot[1]))
                    continue
            # no rings (ZeroMQ data plane), or this worker refused them or has no free slot: over ZeroMQ
            sent.append(self._send_over_channel(
                worker_index, num_slot_tokens, step_id, layer, micro_batch, x[device_index],
                routing.ids[token_index], routing.weights[token_index], slot_mask, device_index,
                self._upload(slot_mask) if self.placement_invariant else slot_mask))
        if self.local_index in slot_tokens:
            local_mask = self._upload(owner == self.local_index)  # [T, K] on the attention device
            sent.append(self._compute_local(layer, x, ids, weights, local_mask, slot_tokens[self.local_index]))
            sent.sort(key=lambda entry: entry.worker_index)  # finish adds in ascending worker index
        return PendingMoE(layer, micro_batch, x.shape[0], ids.shape[1], x.shape[1], x.dtype, x.device, sent)

    def _compute_local(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       slot_mask: torch.Tensor | None, num_slot_tokens: int, count_known: bool = True) -> _Sent:
        """The local share of the micro-batch (x [T, D], ids / weights [T, K], slot_mask [T, K] on the device,
        None: every slot), computed now: [T, K, D] per slot in placement-invariant mode or over every slot,
        else its sum [T, D].
        count_known False: num_slot_tokens was not counted (no read-back), so every slot runs, masked."""
        num_selected = num_slot_tokens if slot_mask is not None and count_known else None
        per_slot = self.local_experts.slot_outputs(layer, x, ids, weights, slot_mask, num_selected)  # [T, K, D]
        # every slot here (slot_mask None): kept per slot for `finish` to hand on unsummed
        output = per_slot if self.placement_invariant or slot_mask is None else sum_slots_in_order(per_slot)
        self.num_slot_tokens_in_flight[self.local_index] += num_slot_tokens
        self.num_slot_tokens_sent[self.local_index] += num_slot_tokens
        return _Sent(self.local_index, 0, slice(None), slot_mask, 0, num_slot_tokens, local_output=output)

    def _send_over_channel(self, worker_index: int, num_slot_tokens: int, step_id: int, layer: int,
                           micro_batch: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                           slot_mask: torch.Tensor, token_index: torch.Tensor, finish_mask: torch.Tensor) -> _Sent:
        """One Dispatch (id `self._dispatch_ids`) of a worker's rows over the ZeroMQ channel, counted in
        flight. hidden [T_w, D], expert_ids / weights / slot_mask [T_w, K]; token_index [T_w] and
        finish_mask [T_w, K]: where `finish` adds the answer."""
        dispatch = Dispatch(
            dispatch_id=self._dispatch_ids, step_id=step_id, layer=layer, micro_batch=micro_batch,
            hidden=hidden.contiguous(), expert_ids=expert_ids.to(torch.int32).contiguous(),
            weights=weights.float().contiguous(), per_expert_outputs=self.placement_invariant,
            slot_mask=slot_mask.contiguous(),
        )
        ticket = self.channel.send(worker_index, dispatch)
        self.num_slot_tokens_in_flight[worker_index] += num_slot_tokens
        self.num_slot_tokens_sent[worker_index] += num_slot_tokens
        return _Sent(worker_index, ticket, token_index, finish_mask, self._dispatch_ids, num_slot_tokens)

    def _start_whole(self, step_id: int, micro_batch: int, layer: int, x: torch.Tensor, ids: torch.Tensor,
                     weights: torch.Tensor) -> PendingMoE | None:
        """CUDA IPC fast path: the layer's only holder gets the whole micro-batch, no host sync
        (dispatch_slots.py); None when that does not apply."""
        if self.slot_plane is None or self.slot_owners.router.has_choice(layer):
            return None
        worker_index = self.slot_owners.layer_holders().sole(layer)
        if worker_index is None:
            return None
        self._dispatch_ids += 1
        sent_slot = self.slot_plane.try_send(worker_index, dispatch_id=self._dispatch_ids, step_id=step_id,
                                             layer=layer, micro_batch=micro_batch, x=x, ids=ids, weights=weights,
                                             slot_mask=None)
        if sent_slot is None:
            return None
        num_slot_tokens = ids.numel()
        self.num_slot_tokens_in_flight[worker_index] += num_slot_tokens
        self.num_slot_tokens_sent[worker_index] += num_slot_tokens
        # [T, K]: read by finish only in placement-invariant mode
        every_slot = torch.ones(ids.shape, dtype=torch.bool, device=ids.device) if self.placement_invariant else None
        sent = [_Sent(worker_index, sent_slot[0], slice(None), every_slot, self._dispatch_ids, num_slot_tokens,
                      slot=sent_slot[1])]
        return PendingMoE(layer, micro_batch, x.shape[0], ids.shape[1], x.shape[1], x.dtype, x.device, sent)

    def every_layer_here(self) -> bool:
        """Whether this process computes every routed expert of every layer: each layer's only holder is the
        attention worker itself (no replicas) and its kernels need no host sync. A decode step then sends
        no message and waits on nothing, so its whole layer loop can be one CUDA graph (graph_decode.py)."""
        return (self.slot_owners.layer_holders().all_held_by(self.local_index)
                and self.local_experts.capturable(self.device))

    def record_local_work(self, num_slot_tokens: int) -> None:
        """Count expert-slot pairs computed here by a replayed step graph (which does not run `start`)."""
        self._grow_counters()
        self.num_slot_tokens_sent[self.local_index] += num_slot_tokens

    def _start_mailboxes(self, micro_batch: int, layer: int, x: torch.Tensor, ids: torch.Tensor,
                         weights: torch.Tensor) -> PendingMoE | None:
        """Mailbox path: every remote holder of the layer takes the whole micro-batch through its mailbox, the
        local share (if any) is computed meanwhile; None when that does not apply (replicas, too many rows,
        a holder without a mailbox)."""
        if micro_batch != 0 or x.shape[0] > self.mailboxes.config.max_tokens or not self._mailboxes_take(layer):
            return None
        owners = self.slot_owners
        holders = owners.layer_holders().holders[layer]
        remote = [w for w in holders if w != self.local_index]
        local_here = self.local_index in holders
        # [T, K] worker index per slot, on the attention device: for the local share's mask and per-slot combine
        slot_owner = owners.owner[layer][ids.long()] if local_here or self.placement_invariant else None
        if ids.device.type == "cpu":  # per-worker slot counts (load statistics); not read back from a device
            counts = torch.bincount(owners.owner_host[layer][ids.long()].reshape(-1),
                                    minlength=len(self.num_slot_tokens_in_flight)).tolist()
        else:
            counts = [0] * len(self.num_slot_tokens_in_flight)
        sent = self.mailboxes.post(layer, remote, x, ids, weights, slot_owner, counts)
        for worker_index in remote:
            self.num_slot_tokens_in_flight[worker_index] += counts[worker_index]
            self.num_slot_tokens_sent[worker_index] += counts[worker_index]
        if local_here:
            sent.append(self._compute_local(layer, x, ids, weights, slot_owner == self.local_index,
                                            counts[self.local_index], count_known=ids.device.type == "cpu"))
            sent.sort(key=lambda entry: entry.worker_index)  # finish adds in ascending worker index
        return PendingMoE(layer, micro_batch, x.shape[0], ids.shape[1], x.shape[1], x.dtype, x.device, sent)

    @property
    def mailbox_plane(self) -> MailboxPlane | None:
        return None if self.mailboxes is None else self.mailboxes.plane

    def _mailboxes_take(self, layer: int) -> bool:
        self.slot_owners.refresh()
        return self.mailboxes.takes(layer, self.slot_owners.layer_holders(), self.local_index,
                                    self.slot_owners.version_key)

    def device_step_ready(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` rows runs on the device alone, layer after layer, so one CUDA graph
        can hold it: each layer's holders (no replicas) are this process (capturable kernels) or expert
        workers reached through mailboxes that carry that many rows (offered here if they have none)."""
        if self.every_layer_here():
            return True
        if self.mailboxes is None:
            return False
        self.slot_owners.refresh()
        return self.mailboxes.step_ready(num_tokens, self.slot_owners.layer_holders(), self.local_index,
                                         lambda: self.local_experts.capturable(self.device),
                                         self.slot_owners.version_key)

    def finish(self, pending: PendingMoE) -> torch.Tensor:
        """Wait for every answer of `pending` -> routed output [T, D], combined in the fixed order; or, where
        this process computed every slot (the layer's sole holder), its per-slot outputs [T, K, D] as they
        are: `AttentionSide.ffn_post` sums them in slot order inside hc_post's launch (the same bits)."""
        if len(pending.sent) == 1 and pending.sent[0].local_output is not None and pending.sent[0].slot_mask is None:
            sent = pending.sent[0]  # every slot computed here
            self.num_slot_tokens_in_flight[sent.worker_index] -= sent.num_slot_tokens
            return self._output(pending, sent)  # [T, K, D]
        if not self.placement_invariant and len(pending.sent) == 1:
            sent = pending.sent[0]
            if isinstance(sent.token_index, slice) and (sent.local_output is not None or sent.mailbox):
                # one holder answered every row with a tensor of its own (not a ring view): its partial sums
                # are the output, with no zero fill and add
                self.num_slot_tokens_in_flight[sent.worker_index] -= sent.num_slot_tokens
                return self._output(pending, sent)
        if self.placement_invariant:
            per_slot = torch.zeros(pending.num_tokens, pending.num_slots, pending.hidden_size, dtype=pending.dtype,
                                   device=pending.device)  # [T, K, D]
        else:
            routed = torch.zeros(pending.num_tokens, pending.hidden_size, dtype=pending.dtype, device=pending.device)
        for sent in pending.sent:  # ascending worker index
            output = self._output(pending, sent)
            self.num_slot_tokens_in_flight[sent.worker_index] -= sent.num_slot_tokens
            if self.placement_invariant and sent.slot_mask is None:  # [T, K, D]: every slot is this holder's
                per_slot[sent.token_index] = output
            elif self.placement_invariant:  # [T_w, K, D]: take only our slots from this worker
                rows = per_slot[sent.token_index]
                per_slot[sent.token_index] = torch.where(sent.slot_mask[..., None], output, rows)
            else:  # [T_w, D]
                routed[sent.token_index] += output
            if sent.slot is not None:  # the ring output was consumed above (stream order): slot reusable
                self.slot_plane.release(sent.worker_index, sent.slot)
        return sum_slots_in_order(per_slot) if self.placement_invariant else routed

    def _output(self, pending: PendingMoE, sent: _Sent) -> torch.Tensor:
        """One holder's answer on the attention device in the activation dtype (waits for it)."""
        if sent.local_output is not None:
            return sent.local_output.to(pending.dtype)
        if sent.mailbox:
            output = self.mailbox_plane.collect(sent.worker_index, pending.layer, sent.ticket, pending.num_tokens)
            return output.to(pending.device, pending.dtype)
        return self._to_device(self._answer(pending, sent)).to(pending.dtype)

    def _to_device(self, received: torch.Tensor) -> torch.Tensor:
        """A received (read-only, host) tensor on the attention device, through the landing ring."""
        if received.is_cuda:  # a CUDA IPC ring view (ZeroMQ replies are host frames)
            return received
        if received.numel() * received.element_size() > self.recv_slot_bytes:
            self.num_unstaged_receives += 1
            return received.to(self.recv_ring.device)
        return self.recv_ring.to_device(received)

    def _forget_ring(self, sent: _Sent) -> None:
        """A worker that failed a slot Dispatch may have restarted without our rings: offer new ones next
        time (the old slot is never reused: it stays out of the free list)."""
        if sent.slot is not None:
            self.slot_plane.forget(sent.worker_index)

    def _answer(self, pending: PendingMoE, sent: _Sent) -> torch.Tensor:
        endpoint = self.channel.endpoints[sent.worker_index]
        if sent.slot is not None and self.slot_plane.defers(sent.worker_index):  # no host wait: confirmed later
            return self.slot_plane.deferred_output(
                sent.worker_index, sent.slot, sent.ticket, dispatch_id=sent.dispatch_id, layer=pending.layer,
                num_tokens=pending.num_tokens if isinstance(sent.token_index, slice) else len(sent.token_index))
        try:
            reply = self.channel.receive(sent.worker_index, sent.ticket)
        except ReplyTimeout as error:
            self._forget_ring(sent)
            raise ExpertWorkerLost(sent.worker_index, endpoint, f"layer {pending.layer}: {error}") from error
        if isinstance(reply, ErrorReply):
            self._forget_ring(sent)
            raise ExpertWorkerLost(sent.worker_index, endpoint, f"layer {pending.layer}: {reply.code}: {reply.message}")
        if sent.slot is not None:
            num_rows = pending.num_tokens if isinstance(sent.token_index, slice) else len(sent.token_index)
            output = self.slot_plane.output(sent.worker_index, sent.slot, reply, dispatch_id=sent.dispatch_id,
                                            layer=pending.layer, num_tokens=num_rows)
            if isinstance(output, str):
                raise ExpertWorkerLost(sent.worker_index, endpoint, output)
            return output
        if not isinstance(reply, Combine) or reply.dispatch_id != sent.dispatch_id or reply.layer != pending.layer:
            raise ExpertWorkerLost(sent.worker_index, endpoint, f"answered dispatch {sent.dispatch_id} with "
                                   f"{type(reply).__name__} {getattr(reply, 'dispatch_id', None)}")
        expected = ((len(sent.token_index), pending.num_slots, pending.hidden_size) if self.placement_invariant
                    else (len(sent.token_index), pending.hidden_size))
        if tuple(reply.output.shape) != expected:
            raise ExpertWorkerLost(sent.worker_index, endpoint,
                                   f"combine output {tuple(reply.output.shape)}, expected {expected}")
        return reply.output
