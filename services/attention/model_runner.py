"""The attention worker's layer loop over one or more micro-batches (docs/design.md §2 step 3).

Each micro-batch is a `ForwardBatch` over some of the step's sequences. Its device work between two
MoE dispatches is one segment (`LayerSegments`): segment l runs ffn_post of layer l-1 (segment 0
embeds instead), then attention, ffn_pre and gate of layer l; segment L only the last ffn_post; the
shared expert of each layer is a segment apart. `ModelRunner.run_segments` is the one loop: per
layer and micro-batch, the previous layer's routed answer -> segment -> send the routed part
(Dispatch) -> shared expert. A `SegmentRun` says how the segments execute: the segment functions
(eager) or replays of CUDA graphs captured from them (graph_decode.py, `--cuda-graphs on`).
A micro-batch's routed answers are collected only when it comes back for its next layer, so with
two or more micro-batches B's attention runs while A's Dispatch is in flight (ping-pong); with one,
every layer waits for its experts. Micro-batches never share sequences, and every sequence sees the
same per-token computation in either schedule (only the batch sizes of the linears change).
With the CUDA IPC data plane ordered by stream flags, `finish` does not wait on the host at all
(the stream waits on the device); the replies are confirmed once at the end of the step
(`dispatcher.confirm_all`), before any state is finished, so a lost expert still fails the step.
`OverlapStats` counts the segment time spent while another micro-batch had a dispatch in flight
(logged per step, kept for `bench` and tests). With a `RoutingCounter`, every layer's gate ids are
counted per (layer, expert) and phase on the device (no host sync).
Legend: T tokens, N hc streams, D hidden, K top-k, L layers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moemesh.common.kernels.moe_layout import sum_slots_in_order
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.batch import ForwardBatch, SequenceChunk
from moemesh.services.attention.moe_dispatch import MoEDispatcher
from moemesh.services.attention.routing_stats import RoutingCounter


class LayerSegments:
    """One micro-batch's segments over `batch` (a ForwardBatch or a graph set's static tables), `token_ids` [T].
    Outputs per layer: h_in [T, N, D] (entering layer l; h_in[L]: the final streams), h [T, N, D], x [T, D],
    post, comb, ids, weights [T, K], shared [T, D]; keep_layers: all layers' stay referenced (captured graphs
    read them from their pool), else only the newest. routed_in [T, D]: a static buffer the routed answer
    is copied into (captured segment graphs read it; per-slot answers are summed into it); None: the answer
    is used as given, per-slot answers [T, K, D] summed inside ffn_post's hc_post launch."""

    def __init__(self, side: AttentionSide, batch, token_ids: torch.Tensor, routed_in: torch.Tensor | None = None,
                 keep_layers: bool = False) -> None:
        self.side = side
        self.batch = batch
        self.token_ids = token_ids
        self.routed_in = routed_in
        self.keep_layers = keep_layers
        self.num_layers = side.config.num_hidden_layers
        self.outputs: dict[str, dict[int, torch.Tensor]] = {
            name: {} for name in ("h_in", "h", "x", "post", "comb", "ids", "weights", "shared")}
        self._routed: torch.Tensor | None = None

    def output(self, name: str, layer: int, num_rows: int) -> torch.Tensor:
        return self.outputs[name][layer][:num_rows]

    def _put(self, name: str, layer: int, value: torch.Tensor) -> None:
        if self.keep_layers:
            self.outputs[name][layer] = value
        else:
            self.outputs[name] = {layer: value}

    def set_routed(self, routed: torch.Tensor) -> None:
        """The routed answer of the last dispatched layer, for the next segment: its sum [T_real, D], or the
        per-slot outputs [T_real, K, D] of an in-process holder of every slot (`MoEDispatcher.finish`)."""
        if self.routed_in is None:
            self._routed = routed
        elif routed.dim() == 3:  # [T, K, D]: the segment graphs were captured reading a sum
            self.routed_in[: routed.shape[0]].copy_(sum_slots_in_order(routed))
        else:
            self.routed_in[: routed.shape[0]].copy_(routed)

    def segment(self, layer: int) -> None:
        side, out = self.side, self.outputs
        if layer == 0:
            h = side.embed_tokens(self.token_ids, self.batch)  # [T, N, D]; the step's RoPE tables
        else:
            routed = self.routed_in if self.routed_in is not None else self._routed
            self._routed = None
            h = side.ffn_post(layer - 1, routed, out["h"][layer - 1], out["post"][layer - 1], out["comb"][layer - 1],
                              shared=out["shared"][layer - 1])
        self._put("h_in", layer, h)
        if layer == self.num_layers:
            return
        h = side.attn_block(layer, h, self.batch)
        x, post, comb = side.ffn_pre(layer, h)  # x [T, D]
        ids, weights = side.gate(layer, x, self.token_ids)  # [T, K]
        for name, value in (("h", h), ("x", x), ("post", post), ("comb", comb), ("ids", ids), ("weights", weights)):
            self._put(name, layer, value)

    def shared(self, layer: int) -> None:
        self._put("shared", layer, self.side.shared_expert(layer, self.outputs["x"][layer]))
        if not self.keep_layers:  # what the next segment does not read is released here
            self.outputs.update(h_in={}, x={}, ids={}, weights={})

    def functions(self) -> tuple[list[Callable], list[Callable]]:
        """(segment callables [L + 1], shared-expert callables [L])."""
        return ([functools.partial(self.segment, i) for i in range(self.num_layers + 1)],
                [functools.partial(self.shared, i) for i in range(self.num_layers)])


@dataclass
class SegmentRun:
    """One micro-batch in `ModelRunner.run_segments`: `segments` (outputs, read as their first `num_tokens`
    rows; routed input), `run_segment` [L + 1] / `run_shared` [L] (the segment functions or graph replays),
    `finish` (after the step's replies were confirmed: advances the states)."""

    segments: LayerSegments
    num_tokens: int
    run_segment: list[Callable[[], None]]
    run_shared: list[Callable[[], None]]
    finish: Callable[[], None]


def eager_run(side: AttentionSide, token_ids: torch.Tensor, chunks: list[SequenceChunk]) -> SegmentRun:
    """The eager SegmentRun of one micro-batch: its segment functions over a ForwardBatch."""
    batch = ForwardBatch(chunks, token_ids.device)
    if batch.num_tokens != token_ids.shape[0]:
        raise ValueError(f"{token_ids.shape[0]} token ids for {batch.num_tokens} new tokens")
    segments = LayerSegments(side, batch, token_ids)
    run_segment, run_shared = segments.functions()
    return SegmentRun(segments, token_ids.shape[0], run_segment, run_shared, batch.finish)


@dataclass
class OverlapStats:
    num_layer_runs: int = 0
    num_overlapped_runs: int = 0  # segment runs while another micro-batch's dispatch was in flight
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
        # logits [T, V] of every token of the last step when a step graph computed them (one micro-batch,
        # rows in order; a view valid until the next step), else None
        self.step_logits: torch.Tensor | None = None

    @torch.inference_mode()
    def forward(self, step_id: int, micro_batches: list[tuple[torch.Tensor, list[SequenceChunk]]],
                decode_masks: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """[(token_ids [T_i], chunks_i)] -> final streams h [T_i, N, D] per micro-batch; advances states.
        decode_masks[i] [T_i] bool marks generated tokens for the routing counts (None: all prompt).
        With graphs (graph_decode.DecodeGraphs.execute: the whole step as one replay when every routed expert
        is computed here, else replays of the segments), a decode step's outputs are views of static buffers,
        valid until the next step."""
        masks = list(decode_masks or [None] * len(micro_batches))
        self.step_logits = None
        if self.graphs is not None:  # graph replays: one for the whole step, or one per segment
            finals = self.graphs.execute(self, step_id, micro_batches, masks)
            if finals is not None:
                return finals
        runs = [eager_run(self.side, token_ids, chunks) for token_ids, chunks in micro_batches]
        return self.run_segments(step_id, runs, masks)

    def run_segments(self, step_id: int, runs: list[SegmentRun],
                     decode_masks: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """The layer loop over the micro-batches `runs` -> final streams h [T_i, N, D] per micro-batch."""
        num_layers = self.config.num_hidden_layers
        masks = list(decode_masks or [None] * len(runs))
        begin = getattr(self.dispatcher, "begin_step", None)
        if begin is not None and runs:  # first thing of the step: expert workers' graphs start while layer 0 runs
            begin(runs[0].num_tokens)
        pending: list = [None] * len(runs)
        captured: list[list[torch.Tensor]] = [[] for _ in runs]
        for layer in range(num_layers + 1):
            for index, run in enumerate(runs):
                segments, size = run.segments, run.num_tokens
                if pending[index] is not None:
                    started_s = time.perf_counter()
                    routed = self.dispatcher.finish(pending[index])  # [T, D], or [T, K, D] per slot
                    self.stats.wait_s += time.perf_counter() - started_s
                    segments.set_routed(routed)
                    pending[index] = None
                in_flight = any(ticket is not None for ticket in pending)
                started_s = time.perf_counter()
                run.run_segment[layer]()
                if layer and layer - 1 in self.capture_layer_ids:
                    captured[index].append(segments.output("h_in", layer, size).mean(dim=1))  # [T, N, D] -> [T, D]
                if layer == num_layers:
                    continue
                ids = segments.output("ids", layer, size)
                if self.routing is not None:
                    self.routing.add(layer, ids, masks[index])
                pending[index] = self.dispatcher.start(step_id, index, layer, segments.output("x", layer, size), ids,
                                                       segments.output("weights", layer, size))  # in flight from here
                run.run_shared[layer]()  # overlaps the expert round trip
                self.stats.num_layer_runs += 1
                if in_flight:
                    self.stats.num_overlapped_runs += 1
                    self.stats.overlapped_s += time.perf_counter() - started_s
        confirm = getattr(self.dispatcher, "confirm_all", None)
        if confirm is not None:  # deferred CUDA IPC replies: every expert answered well (else it raises)
            confirm()
        for run in runs:
            run.finish()
        self.captured = captured
        return [run.segments.output("h_in", num_layers, run.num_tokens) for run in runs]
