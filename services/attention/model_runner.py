"""The attention worker's layer loop over one or more micro-batches (docs/design.md §2 step 3).

Each micro-batch is a `ForwardBatch` over some of the step's sequences. Per layer and
micro-batch: attention -> ffn_pre -> gate -> send the routed part (Dispatch) -> shared expert;
the routed answers of a micro-batch are collected only when that micro-batch comes back for
its next layer. So with two or more micro-batches, micro-batch B's attention runs while
micro-batch A's Dispatch is in flight (ping-pong); with one, every layer waits for its experts.
Micro-batches never share sequences, and every sequence sees the same per-token computation in
either schedule (only the batch sizes of the linears change).
With the CUDA IPC data plane ordered by stream flags, `finish` does not wait on the host at all
(the stream waits on the device); the replies are confirmed once at the end of the step
(`dispatcher.confirm_all`), before any state is finished, so a lost expert still fails the step.
`OverlapStats` counts the attention time spent while another micro-batch had a dispatch in
flight; it is logged per step (debug) and kept for `bench` and tests. With a `RoutingCounter`,
every layer's gate ids are counted per (layer, expert) and phase on the device (no host sync).
With `graphs` set (a `graph_decode.DecodeGraphs`, worker option `--cuda-graphs on`), decode steps
(one new token per sequence, at most the largest bucket per micro-batch) replay CUDA graphs of the
segments between dispatches in this same order; every other step runs the eager loop below.
Legend: T tokens, N hc streams, D hidden, K top-k, V vocab, B sequences that sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.batch import ForwardBatch, SequenceChunk
from moemesh.services.attention.moe_dispatch import MoEDispatcher, PendingMoE
from moemesh.services.attention.routing_stats import RoutingCounter


@dataclass
class MicroBatch:
    token_ids: torch.Tensor  # [T]
    batch: ForwardBatch
    h: torch.Tensor | None = None  # [T, N, D]
    pending: tuple[PendingMoE, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # ticket, shared, post, comb
    is_decode: torch.Tensor | None = None  # [T] bool: generated (not prompt) tokens, for routing counts
    captured: list[torch.Tensor] = field(default_factory=list)  # [T, D] per capture layer, stream means


@dataclass
class OverlapStats:
    num_layer_runs: int = 0
    num_overlapped_runs: int = 0  # attention runs while another micro-batch's dispatch was in flight
    overlapped_s: float = 0.0
    wait_s: float = 0.0  # time blocked on expert answers


class ModelRunner:
    def __init__(self, side: AttentionSide, dispatcher: MoEDispatcher, routing: RoutingCounter | None = None) -> None:
        self.side = side
        self.dispatcher = dispatcher
        self.routing = routing
        self.config = side.config
        self.stats = OverlapStats()
        # Speculation hook (services/attention/speculation.py): after these layers, the stream
        # mean of h [T, D] is kept per micro-batch; `captured[i]` lists them in layer order.
        self.capture_layer_ids: frozenset[int] = frozenset()
        self.captured: list[list[torch.Tensor]] = []
        self.graphs = None  # services.attention.graph_decode.DecodeGraphs: CUDA graphs of decode steps

    @torch.inference_mode()
    def forward(self, step_id: int, micro_batches: list[tuple[torch.Tensor, list[SequenceChunk]]],
                decode_masks: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """[(token_ids [T_i], chunks_i)] -> final streams h [T_i, N, D] per micro-batch; advances states.
        decode_masks[i] [T_i] bool marks generated tokens for the routing counts (None: all prompt).
        With graphs, a decode step's outputs are views of static buffers, valid until the next step."""
        if self.graphs is not None:
            keys = self.graphs.plan(micro_batches)  # None: this step runs eagerly
            if keys is not None:
                return self.graphs.forward(self, step_id, micro_batches, keys, decode_masks)
        mbs = [MicroBatch(ids, ForwardBatch(chunks, ids.device)) for ids, chunks in micro_batches]
        for mb, mask in zip(mbs, decode_masks or ()):
            mb.is_decode = mask
        for mb in mbs:
            if mb.batch.num_tokens != mb.token_ids.shape[0]:
                raise ValueError(f"{mb.token_ids.shape[0]} token ids for {mb.batch.num_tokens} new tokens")
            mb.h = self.side.embed_tokens(mb.token_ids)
        for layer in range(self.config.num_hidden_layers):
            for index, mb in enumerate(mbs):
                self._finish_moe(mb)
                in_flight = any(other.pending is not None for other in mbs if other is not mb)
                started_s = time.perf_counter()
                self._attention_and_dispatch(step_id, index, layer, mb)
                self._count(index, layer, in_flight, time.perf_counter() - started_s)
        for mb in mbs:
            self._finish_moe(mb)
        confirm = getattr(self.dispatcher, "confirm_all", None)
        if confirm is not None:  # deferred CUDA IPC replies: every expert answered well (else it raises)
            confirm()
        for mb in mbs:
            mb.batch.finish()
        self.captured = [mb.captured for mb in mbs]
        return [mb.h for mb in mbs]

    def _attention_and_dispatch(self, step_id: int, index: int, layer: int, mb: MicroBatch) -> None:
        side = self.side
        h = side.attn_block(layer, mb.h, mb.batch)
        x, post, comb = side.ffn_pre(layer, h)  # x [T, D]
        ids, weights = side.gate(layer, x, mb.token_ids)  # [T, K]
        if self.routing is not None:
            self.routing.add(layer, ids, mb.is_decode)
        ticket = self.dispatcher.start(step_id, index, layer, x, ids, weights)  # in flight from here
        shared = side.shared_expert(layer, x)  # overlaps the expert round trip
        mb.h = h
        mb.pending = (ticket, shared, post, comb)

    def _finish_moe(self, mb: MicroBatch) -> None:
        if mb.pending is None:
            return
        ticket, shared, post, comb = mb.pending
        started_s = time.perf_counter()
        routed = self.dispatcher.finish(ticket)  # [T, D]
        self.stats.wait_s += time.perf_counter() - started_s
        mb.h = self.side.ffn_post(ticket.layer, routed + shared, mb.h, post, comb)
        mb.pending = None
        if ticket.layer in self.capture_layer_ids:
            mb.captured.append(mb.h.mean(dim=1))  # [T, N, D] -> [T, D]

    def _count(self, index: int, layer: int, in_flight: bool, elapsed_s: float) -> None:
        self.stats.num_layer_runs += 1
        if in_flight:
            self.stats.num_overlapped_runs += 1
            self.stats.overlapped_s += elapsed_s
