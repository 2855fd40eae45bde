"""Decode steps of the attention worker's layer loop with CUDA graphs of the segments between MoE dispatches.

`ModelRunner.forward` (services/attention/model_runner.py) runs, per layer and micro-batch: finish the
previous layer's routed answer -> ffn_post -> attention -> ffn_pre -> gate -> send the routed part ->
shared expert. Here the device work between two dispatches is one captured graph (`segment`: ffn_post
of layer l-1, then attention, ffn_pre and gate of layer l; the first also embeds, the last also runs
the head) plus one for the shared expert (captured apart so the Dispatch leaves before it runs); the
host only replays graphs and drives the real `MoEDispatcher` between them, in `ModelRunner`'s order,
so micro-batch B's segment replays while A's Dispatch is away (ping-pong). The routed answer enters
the next segment through a static buffer per micro-batch (`routed_in`).

Positions are baked into a captured attention step (ring index, rows, a compression window closing),
as in `bench.layers_timing`: steps 0..S-1 at consecutive positions are captured once (each after an
eager warm-up with the in-process experts, rolled back) and replayed in order; each replay rewrites
the same positions. With S = 1 every replay equals one eager step from the captured state (the CUDA
test compares them); with S > 1 replays are for timing (later steps' ring writes are visible to step 0
of the next pass). A serving attention worker cannot replay these as they are: its positions change
every step; that needs position-independent attention kernels (positions read from device tensors).
Legend: B sequences, T tokens, D hidden, N hc streams.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moemesh.bench.timing import median, wall_s

from moemesh.common.model.batch import ForwardBatch


@dataclass
class _MicroBatchGraphs:
    token_ids: torch.Tensor  # [T]
    routed_in: torch.Tensor  # [T, D] static: the routed answer the next segment reads
    segments: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # L + 1 (the last: ffn_post + head)
    shared: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # L
    gate_outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # x, ids, w
    buf: dict[str, Any] = field(default_factory=dict)


def _segment_fns(side, batch: ForwardBatch, mb: _MicroBatchGraphs, num_layers: int) -> tuple[list, list]:
    """(segment functions [L + 1], shared-expert functions [L]) over `mb.buf`."""
    buf = mb.buf

    def segment(layer: int) -> Callable[[], None]:
        def run() -> None:
            if layer == 0:
                h = side.embed_tokens(mb.token_ids)  # [T, N, D]
            else:
                h = side.ffn_post(layer - 1, mb.routed_in + buf["shared"], buf["h"], buf["post"], buf["comb"])
            if layer == num_layers:
                buf["h"] = h
                buf["logits"] = side.logits(h)
                return
            h = side.attn_block(layer, h, batch)
            x, post, comb = side.ffn_pre(layer, h)  # x [T, D]
            ids, weights = side.gate(layer, x, mb.token_ids)  # [T, K]
            buf.update(h=h, x=x, post=post, comb=comb, ids=ids, weights=weights)
        return run

    def shared(layer: int) -> Callable[[], None]:
        def run() -> None:
            buf["shared"] = side.shared_expert(layer, buf["x"])
        return run

    return [segment(i) for i in range(num_layers + 1)], [shared(i) for i in range(num_layers)]


class SegmentGraphDecode:
    """Captured decode steps (S positions x M micro-batches); `step(s, dispatcher)` replays step s."""

    def __init__(self, side, states: list, token_ids: torch.Tensor, num_micro_batches: int, num_graph_steps: int,
                 warm_experts: Any) -> None:
        from moemesh.services.attention.worker import split_micro_batches

        self.side = side
        self.states = states
        self.num_layers = side.config.num_hidden_layers
        self.groups = split_micro_batches(len(states), num_micro_batches)
        self.device = token_ids.device
        self.pool = torch.cuda.graph_pool_handle()
        self.steps: list[list[_MicroBatchGraphs]] = []
        self._keep_alive: list = []
        with torch.inference_mode():
            for _ in range(num_graph_steps):
                self._warm_up(token_ids, warm_experts)
                self.steps.append(self._capture(token_ids))

    def _new_micro_batches(self, token_ids) -> tuple[list[_MicroBatchGraphs], list[ForwardBatch]]:
        from moemesh.common.model.batch import SequenceChunk

        dtype, hidden = self.side.dtype, self.side.config.hidden_size
        mbs, batches = [], []
        for group in self.groups:
            ids = token_ids[group.start:group.stop]
            mbs.append(_MicroBatchGraphs(ids, torch.zeros(len(group), hidden, dtype=dtype, device=self.device)))
            batches.append(ForwardBatch([SequenceChunk(self.states[i], 1) for i in group], self.device))
        return mbs, batches

    def _warm_up(self, token_ids, experts) -> None:
        """One eager step with the in-process experts (Triton compiles, cuBLAS handles), then undone."""
        mbs, batches = self._new_micro_batches(token_ids)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for mb, batch in zip(mbs, batches):
                segments, shared = _segment_fns(self.side, batch, mb, self.num_layers)
                for layer in range(self.num_layers):
                    segments[layer]()
                    shared[layer]()
                    mb.routed_in.copy_(experts(layer, mb.buf["x"], mb.buf["ids"], mb.buf["weights"]))
                segments[self.num_layers]()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for batch in batches:
            batch.finish()
        for state in self.states:
            state.rollback(1)

    def _capture(self, token_ids) -> list[_MicroBatchGraphs]:
        mbs, batches = self._new_micro_batches(token_ids)
        fns = [_segment_fns(self.side, batch, mb, self.num_layers) for mb, batch in zip(mbs, batches)]
        for layer in range(self.num_layers + 1):  # ModelRunner's order: layer-major, micro-batches inside
            for mb, (segments, shared) in zip(mbs, fns):
                mb.segments.append(self._graph(segments[layer]))
                if layer < self.num_layers:
                    mb.gate_outputs.append((mb.buf["x"], mb.buf["ids"], mb.buf["weights"]))
                    mb.shared.append(self._graph(shared[layer]))
        for batch in batches:
            batch.finish()  # the states now stand after this step, as a replay leaves them
        self._keep_alive.append((batches, fns))
        return mbs

    def _graph(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph

    def step(self, step_index: int, dispatcher: Any, step_id: int = 0) -> list[torch.Tensor]:
        """Replay captured step `step_index` with `dispatcher` carrying the routed experts; returns the
        final streams h [T_i, N, D] per micro-batch (static graph outputs: read before the next replay)."""
        mbs = self.steps[step_index]
        pending: list[Any] = [None] * len(mbs)
        for layer in range(self.num_layers + 1):
            for index, mb in enumerate(mbs):
                if pending[index] is not None:
                    mb.routed_in.copy_(dispatcher.finish(pending[index]))
                    pending[index] = None
                mb.segments[layer].replay()
                if layer < self.num_layers:
                    x, ids, weights = mb.gate_outputs[layer]
                    pending[index] = dispatcher.start(step_id, index, layer, x, ids, weights)
                    mb.shared[layer].replay()
        confirm = getattr(dispatcher, "confirm_all", None)
        if confirm is not None:  # deferred CUDA IPC replies, as ModelRunner.forward does
            confirm()
        return [mb.buf["h"] for mb in mbs]


def time_segment_graphs(graphs: SegmentGraphDecode, dispatcher: Any, num_steps: int) -> float:
    """Median seconds per decode step over `num_steps` passes of all captured steps (host clock, synced)."""
    passes = itertools.count()

    def one_pass() -> None:
        step_id = next(passes)
        for step_index in range(len(graphs.steps)):
            graphs.step(step_index, dispatcher, step_id=step_id)

    with torch.inference_mode():
        samples = wall_s(one_pass, graphs.device, warmup=1, repeats=num_steps)  # the first pass is a warm-up
    return median(samples) / len(graphs.steps)
