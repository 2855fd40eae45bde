"""CUDA graphs of the serving attention worker's decode steps, by batch-size bucket.

`ModelRunner.forward` runs, per layer and micro-batch: finish the previous layer's routed answer ->
ffn_post -> attention -> ffn_pre -> gate -> send the routed part -> shared expert. Here the device
work between two dispatches is one captured graph (segment l: ffn_post of layer l-1, then attention,
ffn_pre and gate of layer l; segment 0 embeds, segment L only runs the last ffn_post) plus one for
the shared expert (apart, so the Dispatch leaves before it runs). `DecodeGraphs.forward` replays them
in ModelRunner's order with the real `MoEDispatcher` between them; the routed answer enters the next
segment through a static buffer (`routed_in`). Same schedule, same ping-pong between micro-batches.

Unlike `bench/layers_graphs.py`, nothing of a step is baked in: the positions, ring slots, window
closes, block tables, split sizes and the set of sequences are written before each replay into the
static tables of `graph_tables.StaticDecodeTables` and read by the kernels from device memory.
A graph set is keyed by (micro-batch index, bucket, indexer width class, row-store geometry) and
captured lazily on first use: one eager warm-up of every segment over scratch-only tables (Triton
compiles outside the capture), then the captures. Sets of one micro-batch index share a memory pool:
a step replays exactly one of them, and what a set keeps between its graphs (per-layer outputs) stays
referenced, so another set can only reuse memory that is dead outside its own step. Different
micro-batch indices never share a pool (their replays interleave within a step).

A step runs eagerly instead (ModelRunner's path; logged once per reason) when any micro-batch has a
sequence with more than one new token (prefill chunks, speculative verification), more sequences
than the largest bucket, stores the kernels cannot address, mixed row-store layouts, or a block
table wider than the capacity. With `capture=False` the same segment functions run eagerly over
the static tables (no graph): the CPU tests use it to check the metadata path under
TRITON_INTERPRET=1.
Legend: T tokens (= sequences), Tb bucket tokens, L layers, N hc streams, D hidden, K top-k.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from moemesh.common.kernels.attention_layout import CONTIGUOUS_ROWS_PER_BLOCK
from moemesh.common.kernels.sparse_attention import default_config
from moemesh.common.model.attention_tables import sequence_addresses
from moemesh.common.model.batch import AttentionBackend, SequenceChunk, default_attention_backend
from moemesh.common.model.state import SequenceState
from moemesh.services.attention.graph_tables import StaticDecodeTables, index_rows_class

log = structlog.get_logger("attention")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class DecodeGraphConfig:
    """buckets: batch sizes graphs are captured for (ascending); max_blocks_per_sequence: block-table
    width of the static tables (a paged sequence with more blocks runs eagerly); capture: False runs
    the segment functions eagerly over the static tables (CPU tests of the metadata path)."""

    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_blocks_per_sequence: int = 256
    capture: bool = True


class GraphBatch:
    """What the attention layers read of a ForwardBatch, over static tables (no host state: the
    counters are advanced after the replay by `SequenceState.commit_kernel_writes`)."""

    def __init__(self, tables: StaticDecodeTables) -> None:
        self.attention_tables = tables
        self.positions = tables.positions  # [Tb]
        self.num_tokens = tables.num_tokens
        self.chunks: tuple[SequenceChunk, ...] = ()  # nothing to mark inside the captured layers
        self._rope_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, table) -> tuple[torch.Tensor, torch.Tensor]:
        if table.name not in self._rope_cache:
            self._rope_cache[table.name] = table.cos_sin(self.positions)
        return self._rope_cache[table.name]

    def clear_rope_cache(self) -> None:
        """Each segment computes cos/sin from the static positions itself (a replay then recomputes them
        for the step's positions; a cached tensor from the warm-up would be stale)."""
        self._rope_cache.clear()


@dataclass
class _GraphSet:
    """Static buffers and segments of one key; per-layer outputs stay referenced (nothing reused)."""

    tables: StaticDecodeTables
    batch: GraphBatch
    routed_in: torch.Tensor  # [Tb, D]
    buf: dict[str, list] = field(default_factory=dict)
    segments: list[Callable[[], None]] = field(default_factory=list)  # L + 1
    shared: list[Callable[[], None]] = field(default_factory=list)  # L
    graphs: list[Any] = field(default_factory=list)  # keeps the CUDAGraph objects alive
    pool: Any = None


@dataclass
class GraphStats:
    num_graph_steps: int = 0
    num_eager_steps: int = 0
    num_captures: int = 0
    eager_reasons: dict[str, int] = field(default_factory=dict)


class DecodeGraphs:
    def __init__(self, side, config: DecodeGraphConfig, device: torch.device | str) -> None:
        from moemesh.common.model.random_init import move_rope_tables

        self.side = side
        self.config = config
        self.device = torch.device(device)
        self.buckets = tuple(sorted(config.buckets))
        self.num_layers = side.config.num_hidden_layers
        move_rope_tables(side, self.device)  # no host-to-device copy inside a captured segment
        self.scratch = SequenceState(side.config, dtype=side.dtype, device=self.device)  # padding rows write here
        self._sets: dict[tuple, _GraphSet] = {}
        self._pools: dict[int, Any] = {}  # micro-batch index -> graph memory pool
        self._logged: set[str] = set()
        self.stats = GraphStats()

    # ------------------------------------------------------------------ eligibility
    def bucket_for(self, num_tokens: int) -> int | None:
        return next((bucket for bucket in self.buckets if bucket >= num_tokens), None)

    def plan(self, micro_batches: list[tuple[torch.Tensor, list[SequenceChunk]]]) -> list[tuple] | None:
        """Graph-set keys per micro-batch, or None when the step must run eagerly (logged once per reason)."""
        reason = None
        keys = []
        if self.config.capture and default_attention_backend(self.device) is not AttentionBackend.TRITON:
            reason = "no_triton_attention"
        for index, (_, chunks) in enumerate(micro_batches):
            if reason is not None:
                break
            key, reason = self._key(index, chunks)
            keys.append(key)
        if reason is not None:
            self.stats.num_eager_steps += 1
            self.stats.eager_reasons[reason] = self.stats.eager_reasons.get(reason, 0) + 1
            if reason not in self._logged:
                self._logged.add(reason)
                log.info("attention.graphs_eager_step", reason=reason)
            return None
        return keys

    def _key(self, index: int, chunks: list[SequenceChunk]) -> tuple[tuple | None, str | None]:
        if any(chunk.num_new_tokens != 1 for chunk in chunks):
            return None, "not_decode"
        bucket = self.bucket_for(len(chunks))
        if bucket is None:
            return None, "batch_above_buckets"
        if default_config(len(chunks)) != default_config(bucket):  # tile configs must not change with padding
            return None, "bucket_changes_attention_config"
        config = self.side.config
        geometry = None
        max_csa_rows = 0
        for chunk in chunks:
            state = chunk.state
            if state.layers[0].window.ring.dtype != self.side.dtype:
                return None, "state_dtype"
            state.reserve_tokens(state.num_tokens + 1)
            addresses = sequence_addresses(state)
            if addresses is None:
                return None, "unaddressable_store"
            this = (addresses.paged, tuple(sorted(addresses.rows_per_block.items())))
            if geometry is not None and this != geometry:
                return None, "mixed_row_layouts"
            geometry = this
            if addresses.paged:
                ids = addresses.block_table.block_ids
                if len(ids) > self.config.max_blocks_per_sequence:
                    return None, "block_table_too_wide"
                for (layer, _), per_block in addresses.rows_per_block.items():
                    if len(ids) * per_block < (state.num_tokens + 1) // config.compress_ratio(layer):
                        return None, "block_table_too_short"
            if config.csa_compress_ratio:
                max_csa_rows = max(max_csa_rows, (state.num_tokens + 1) // config.csa_compress_ratio)
        index_rows = index_rows_class(max_csa_rows, config.index_topk) if config.csa_compress_ratio else None
        return (index, bucket, index_rows, geometry), None

    # ------------------------------------------------------------------ the step
    def forward(self, runner, step_id: int, micro_batches: list[tuple[torch.Tensor, list[SequenceChunk]]],
                keys: list[tuple], decode_masks: list[torch.Tensor | None] | None) -> list[torch.Tensor]:
        """Replay one decode step (ModelRunner's order and dispatcher) -> final streams h [T_i, N, D] per
        micro-batch (views of static buffers: valid until this set replays again)."""
        sets = [self._set(key) for key in keys]
        sizes = [len(chunks) for _, chunks in micro_batches]
        states = [[chunk.state for chunk in chunks] for _, chunks in micro_batches]
        for graph_set, (token_ids, chunks), members in zip(sets, micro_batches, states):
            graph_set.tables.fill(members, token_ids, self.scratch)
        masks = list(decode_masks or [None] * len(sets))
        pending: list[Any] = [None] * len(sets)
        captured: list[list[torch.Tensor]] = [[] for _ in sets]
        for layer in range(self.num_layers + 1):
            for index, (graph_set, size) in enumerate(zip(sets, sizes)):
                if pending[index] is not None:
                    started_s = time.perf_counter()
                    routed = runner.dispatcher.finish(pending[index])  # [T, D]
                    runner.stats.wait_s += time.perf_counter() - started_s
                    graph_set.routed_in[:size].copy_(routed)
                    pending[index] = None
                graph_set.segments[layer]()
                if layer and layer - 1 in runner.capture_layer_ids:
                    captured[index].append(graph_set.buf["h_in"][layer][:size].mean(dim=1))  # [T, N, D] -> [T, D]
                if layer == self.num_layers:
                    continue
                x = graph_set.buf["x"][layer][:size]
                ids = graph_set.buf["ids"][layer][:size]
                weights = graph_set.buf["weights"][layer][:size]
                if runner.routing is not None:
                    runner.routing.add(layer, ids, masks[index])
                pending[index] = runner.dispatcher.start(step_id, index, layer, x, ids, weights)
                graph_set.shared[layer]()
                runner.stats.num_layer_runs += 1
        confirm = getattr(runner.dispatcher, "confirm_all", None)
        if confirm is not None:  # deferred CUDA IPC replies: every expert answered well (else it raises)
            confirm()
        for members in states:
            for state in members:
                state.commit_kernel_writes(1)
        runner.captured = captured
        self.stats.num_graph_steps += 1
        return [graph_set.buf["h_in"][self.num_layers][:size] for graph_set, size in zip(sets, sizes)]

    # ------------------------------------------------------------------ building sets
    def _set(self, key: tuple) -> _GraphSet:
        graph_set = self._sets.get(key)
        if graph_set is None:
            graph_set = self._build(key)
            self._sets[key] = graph_set
        return graph_set

    def _build(self, key: tuple) -> _GraphSet:
        _, bucket, index_rows, (paged, rows_per_block) = key
        side = self.side
        rows_per_block = dict(rows_per_block)
        block_width = self.config.max_blocks_per_sequence if paged else 1
        if not paged:
            rows_per_block = {k: CONTIGUOUS_ROWS_PER_BLOCK for k in rows_per_block}
        smaller = [b for b in self.buckets if b < bucket]
        tables = StaticDecodeTables(side.config, bucket, rows_per_block, block_width, index_rows, side.dtype,
                                    self.device, min_real_tokens=(max(smaller) + 1) if smaller else 1)
        routed_in = torch.zeros(bucket, side.config.hidden_size, dtype=side.dtype, device=self.device)
        graph_set = _GraphSet(tables, GraphBatch(tables), routed_in)
        segments, shared = self._functions(graph_set)
        tables.fill([], None, self.scratch)  # warm-up and capture over padding rows only
        if not self.config.capture:
            graph_set.segments, graph_set.shared = segments, shared
            return graph_set
        started_s = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):  # eager warm-up: compiles, workspaces
            for layer in range(self.num_layers + 1):
                segments[layer]()
                if layer < self.num_layers:
                    shared[layer]()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        if key[0] not in self._pools:
            self._pools[key[0]] = torch.cuda.graph_pool_handle()
        graph_set.pool = self._pools[key[0]]
        with torch.inference_mode():
            for layer in range(self.num_layers + 1):
                graph_set.segments.append(self._capture(graph_set, segments[layer]))
                if layer < self.num_layers:
                    graph_set.shared.append(self._capture(graph_set, shared[layer]))
        self.stats.num_captures += 1
        log.info("attention.graphs_captured", micro_batch=key[0], bucket=bucket, index_rows=index_rows,
                 paged=paged, elapsed_s=round(time.perf_counter() - started_s, 3))
        return graph_set

    def _capture(self, graph_set: _GraphSet, fn: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graph_set.pool, capture_error_mode="thread_local"):
            fn()
        graph_set.graphs.append(graph)
        return graph.replay

    def _functions(self, graph_set: _GraphSet) -> tuple[list[Callable[[], None]], list[Callable[[], None]]]:
        """(segment functions [L + 1], shared-expert functions [L]) writing per-layer outputs into `buf`."""
        side, num_layers = self.side, self.num_layers
        tables, batch = graph_set.tables, graph_set.batch
        buf = graph_set.buf
        for name in ("h_in", "h", "x", "post", "comb", "ids", "weights", "shared"):
            buf[name] = [None] * (num_layers + 1)

        def segment(layer: int) -> Callable[[], None]:
            def run() -> None:
                batch.clear_rope_cache()  # cos/sin of this step's positions, computed inside the segment
                if layer == 0:
                    h = side.embed_tokens(tables.token_ids)  # [Tb, N, D]
                else:
                    h = side.ffn_post(layer - 1, graph_set.routed_in + buf["shared"][layer - 1], buf["h"][layer - 1],
                                      buf["post"][layer - 1], buf["comb"][layer - 1])
                buf["h_in"][layer] = h
                if layer == num_layers:
                    return
                h = side.attn_block(layer, h, batch)
                x, post, comb = side.ffn_pre(layer, h)  # x [Tb, D]
                ids, weights = side.gate(layer, x, tables.token_ids)  # [Tb, K]
                buf["h"][layer], buf["x"][layer], buf["post"][layer], buf["comb"][layer] = h, x, post, comb
                buf["ids"][layer], buf["weights"][layer] = ids, weights
            return run

        def shared(layer: int) -> Callable[[], None]:
            def run() -> None:
                buf["shared"][layer] = side.shared_expert(layer, buf["x"][layer])
            return run

        return [segment(i) for i in range(num_layers + 1)], [shared(i) for i in range(num_layers)]
