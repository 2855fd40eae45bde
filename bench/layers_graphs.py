"""Decode steps of the attention worker's layer loop with CUDA graphs of the segments between MoE dispatches.

The loop is `ModelRunner.run_segments` (services/attention/model_runner.py) and the graphs are captured
from its own segments (`LayerSegments`) by `graph_decode.capture_segments`, as the serving worker's
`DecodeGraphs` does: segment l = ffn_post of layer l-1, then attention, ffn_pre and gate of layer l
(segment 0 embeds, segment L only runs the last ffn_post), plus one graph per shared expert (so the
Dispatch leaves before it runs). The host only replays graphs and drives the real `MoEDispatcher`
between them, so micro-batch B's segment replays while A's Dispatch is away (ping-pong). The routed
answer enters the next segment through a static buffer per micro-batch (`routed_in`).

Unlike `DecodeGraphs`, positions are baked into a captured step here (the eager `ForwardBatch`
tables: ring index, rows, a compression window closing), as in `bench.layers_timing`: steps 0..S-1
at consecutive positions are captured once (each after an eager step with the in-process experts,
rolled back) and replayed in order; each replay rewrites the same positions. With S = 1 every replay
equals one eager step from the captured state (the CUDA test compares them); with S > 1 replays are
for timing (later steps' ring writes are visible to step 0 of the next pass).
Legend: B sequences, T tokens, D hidden, N hc streams.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from moemesh.bench.timing import median, wall_s
from moemesh.common.model.batch import ForwardBatch, SequenceChunk
from moemesh.services.attention.graph_decode import capture_segments
from moemesh.services.attention.model_runner import LayerSegments, ModelRunner, SegmentRun


class SegmentGraphDecode:
    """Captured decode steps (S positions x M micro-batches); `step(s, dispatcher)` replays step s."""

    def __init__(self, side, states: list, token_ids: torch.Tensor, num_micro_batches: int, num_graph_steps: int,
                 warm_experts: Any) -> None:
        from moemesh.bench.layers_disagg import LocalDispatcher
        from moemesh.services.attention.worker import split_micro_batches

        self.side = side
        self.states = states
        self.groups = split_micro_batches(len(states), num_micro_batches)
        self.device = token_ids.device
        self.steps: list[list[SegmentRun]] = []
        self._graphs: list = []  # keeps the CUDAGraph objects alive
        self._runner: ModelRunner | None = None
        warm_up = ModelRunner(side, LocalDispatcher(warm_experts))
        with torch.inference_mode():
            for _ in range(num_graph_steps):
                self._warm_up(warm_up, token_ids)
                self.steps.append(self._capture(token_ids))

    def _segments(self, token_ids: torch.Tensor) -> list[LayerSegments]:
        dtype, hidden = self.side.dtype, self.side.config.hidden_size
        segments = []
        for group in self.groups:
            batch = ForwardBatch([SequenceChunk(self.states[i], 1) for i in group], self.device)
            routed_in = torch.zeros(len(group), hidden, dtype=dtype, device=self.device)  # [T, D]
            segments.append(LayerSegments(self.side, batch, token_ids[group.start:group.stop], routed_in,
                                          keep_layers=True))
        return segments

    def _warm_up(self, runner: ModelRunner, token_ids: torch.Tensor) -> None:
        """One eager step with the in-process experts (Triton compiles, cuBLAS handles), then undone."""
        runs = []
        for segments in self._segments(token_ids):
            run_segment, run_shared = segments.functions()
            runs.append(SegmentRun(segments, segments.token_ids.shape[0], run_segment, run_shared,
                                   segments.batch.finish))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            runner.run_segments(0, runs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for state in self.states:
            state.rollback(1)

    def _capture(self, token_ids: torch.Tensor) -> list[SegmentRun]:
        runs = []
        for segments in self._segments(token_ids):
            # a pool per micro-batch: a shared pool is safe only for graphs replayed in the order they were
            # captured, and the layer loop interleaves the micro-batches' segments
            pool = torch.cuda.graph_pool_handle()
            run_segment, run_shared, graphs = capture_segments(segments, pool, self.device, warm_up=False)
            runs.append(SegmentRun(segments, segments.token_ids.shape[0], run_segment, run_shared,
                                   lambda: None))  # the positions are baked in: nothing to advance
            self._graphs.append(graphs)
        for segments in (run.segments for run in runs):
            segments.batch.finish()  # the states now stand after this step, as a replay leaves them
        return runs

    def step(self, step_index: int, dispatcher: Any, step_id: int = 0) -> list[torch.Tensor]:
        """Replay captured step `step_index` through `ModelRunner.run_segments` with `dispatcher` carrying
        the routed experts; returns the final streams h [T_i, N, D] per micro-batch (static graph outputs:
        read before the next replay)."""
        if self._runner is None or self._runner.dispatcher is not dispatcher:
            self._runner = ModelRunner(self.side, dispatcher)
        return self._runner.run_segments(step_id, self.steps[step_index])


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
