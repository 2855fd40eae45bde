"""CUDA graphs of the serving attention worker's decode and verification steps, by token bucket.

The graphs are captured from `ModelRunner`'s own segments (`LayerSegments`, model_runner.py), one
each; `DecodeGraphs.runs` hands `ModelRunner.run_segments` a `SegmentRun` per micro-batch whose
segments are replays, so the loop, the `MoEDispatcher` calls between segments and the ping-pong are
the runner's; the routed answer enters the next segment through a static buffer (`routed_in`).
A whole-step graph (below) has none: its segments take the answers as they come, the in-process experts'
per-slot outputs summed inside the next hc_post launch.
Nothing of a step is baked in: the positions, ring slots, window closes, block tables, split sizes
and the set of sequences are written before each replay into the static tables of
`graph_tables.StaticDecodeTables` and read by the kernels from device memory.
A graph set is keyed by (micro-batch index, bucket, indexer width class, row-store geometry) and
captured lazily on first use: one eager warm-up of every segment over scratch-only tables (Triton
compiles outside the capture), then the captures (`capture_segments`). Sets of one micro-batch index
share a memory pool: a step replays exactly one of them, and what a set keeps between its graphs
(per-layer outputs) stays referenced, so another set can only reuse memory that is dead outside its
own step. Different micro-batch indices never share a pool (their replays interleave within a step).

When a step runs on the device alone (`MoEDispatcher.device_step_ready`: each layer's holders, without
replicas, are the attention worker itself on capturable kernels or CPU expert workers reached through
mailboxes, whose posts, waits and combines are kernels), a step of one micro-batch needs no message and
no host wait between layers, so the whole layer loop is captured as one graph instead:
`ModelRunner.run_segments` itself runs under the capture (segments, routing counts, the in-process
experts, shared experts, combines), then the head over every row, and a step is one replay
(`DecodeGraphs.execute`; the worker samples from the graph's logits, `ModelRunner.step_logits`). Its routing
counts take per-row phases from a static tensor whose padding rows are not counted. A step graph is
tied to the routing table (and the mailbox segments) it was captured under and captured again after a
placement change or a worker's new mailbox; after each replay the mailboxes' error words are read once
(`MoEDispatcher.confirm_all`, read after the step's sampling by `confirm_deferred`), so a worker that did not
answer fails the attempt before anything leaves the worker (recovery rolls its states back).

A step of short chunks runs on graphs too: a sequence may bring up to `max_tokens_per_sequence` new
tokens (speculative verification: the seed and its drafts), the bucket is the micro-batch's token count,
and the tables give each token its sequence and position (`StaticDecodeTables.fill`), so the kernels
treat the chunk causally as an eager forward does; the states then advance by each chunk's length and
verification rolls the rejected drafts back as after an eager step.
A step runs eagerly instead (the runner's eager segments; logged once per reason) when any
micro-batch has a longer chunk (prefill), more tokens than the largest bucket, stores the kernels
cannot address, mixed row-store layouts, or a block table wider than the capacity. With
`capture=False` the same segment functions run eagerly over the static tables (no graph): the CPU
tests use it to check the metadata path under TRITON_INTERPRET=1.
Legend: T tokens, Tb bucket tokens, L layers, N hc streams, D hidden, K top-k.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from moemesh.common.kernels.attention_layout import CONTIGUOUS_ROWS_PER_BLOCK
from moemesh.common.kernels.sparse_attention_plan import default_config
from moemesh.common.model.attention_tables import sequence_addresses
from moemesh.common.model.batch import AttentionBackend, SequenceChunk, default_attention_backend
from moemesh.common.model.kv_storage import KVStorage
from moemesh.common.model.state import SequenceState
from moemesh.common.model.step_graphs import DECODE_GRAPH_BUCKETS, GRAPH_CHUNK_TOKENS
from moemesh.services.attention.graph_tables import StaticDecodeTables, index_rows_class
from moemesh.services.attention.model_runner import LayerSegments, SegmentRun
from moemesh.services.attention.routing_stats import NOT_COUNTED

log = structlog.get_logger("attention")

DEFAULT_BUCKETS = DECODE_GRAPH_BUCKETS
DEFAULT_MAX_TOKENS_PER_SEQUENCE = GRAPH_CHUNK_TOKENS  # the rings' rollback reach (boundary.py, step_graphs.py)


@dataclass(frozen=True)
class DecodeGraphConfig:
    """buckets: token counts graphs are captured for (ascending); max_tokens_per_sequence: the longest chunk
    a graphed step takes (decode 1, verification 1 + drafts; longer chunks, prefills, run eagerly);
    max_blocks_per_sequence: block-table width of the static tables (a paged sequence with more blocks runs
    eagerly); capture: False runs the segment functions eagerly over the static tables (CPU tests of the
    metadata path); kv_storage: how the sequences store their KV rows (sequences stored otherwise run
    eagerly)."""

    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_tokens_per_sequence: int = DEFAULT_MAX_TOKENS_PER_SEQUENCE
    max_blocks_per_sequence: int = 256
    capture: bool = True
    kv_storage: KVStorage = KVStorage.BF16


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

    def set_rope(self, cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set by the first segment (the embedding) from the static positions: its replay recomputes them for
        the step's positions into the same buffers, which the later segments' graphs read."""
        self._rope_cache.update(cos_sin)


@dataclass
class _GraphSet:
    """Static tables and segments of one key, with the callables that replay them."""

    tables: StaticDecodeTables
    segments: LayerSegments  # over the static tables, keep_layers: per-layer outputs stay referenced
    run_segment: list[Callable[[], None]] = field(default_factory=list)  # L + 1
    run_shared: list[Callable[[], None]] = field(default_factory=list)  # L
    graphs: list[Any] = field(default_factory=list)  # keeps the CUDAGraph objects alive


@dataclass
class _StepGraph:
    """One micro-batch's whole decode step as one CUDA graph: `graph_set` (tables and segments it reads),
    `phases` [Tb] int64 routing-count phase per row (padding: NOT_COUNTED), `finals` [Tb, N, D] the final
    streams, `logits` [Tb, V] the head's output of every row, `captured` the speculation hook's [Tb, D]
    means, `routing_token` the (routing table, version, hook layers) it was captured under."""

    graph_set: _GraphSet
    phases: torch.Tensor
    finals: torch.Tensor
    logits: torch.Tensor
    captured: list[torch.Tensor]
    routing_token: tuple
    graph: Any


def capture_segments(segments: LayerSegments, pool: Any, device: torch.device,
                     warm_up: bool = True) -> tuple[list[Callable], list[Callable], list[Any]]:
    """CUDA graphs of every segment of `segments` in `pool` -> (segment replays [L + 1], shared-expert
    replays [L], the graphs). warm_up: first run every segment once eagerly on a side stream (Triton
    compiles and workspaces outside the capture). Captured in step order: the embedding segment first, whose
    RoPE tables the others read."""
    segment_fns, shared_fns = segments.functions()
    in_order = [fn for pair in zip(segment_fns, shared_fns) for fn in pair] + segment_fns[-1:]  # seg 0, shared 0, ...
    if warm_up:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for fn in in_order:
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
    graphs: list[Any] = []

    def capture(fn: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            fn()
        graphs.append(graph)
        return graph.replay

    with torch.inference_mode():
        replays = [capture(fn) for fn in in_order]
    return replays[0::2], replays[1::2], graphs


@dataclass
class GraphStats:
    num_graph_steps: int = 0
    num_step_graph_steps: int = 0  # of which replayed as one graph of the whole step
    num_eager_steps: int = 0
    num_captures: int = 0
    eager_reasons: dict[str, int] = field(default_factory=dict)


class DecodeGraphs:
    def __init__(self, side, config: DecodeGraphConfig, device: torch.device | str) -> None:
        self.side = side
        self.config = config
        self.device = torch.device(device)
        self.buckets = tuple(sorted(config.buckets))
        side.move_rope_tables(self.device)  # no host-to-device copy inside a captured segment
        self.scratch = SequenceState(side.config, dtype=side.dtype, device=self.device,
                                     kv_storage=config.kv_storage)  # padding rows write here
        self._sets: dict[tuple, _GraphSet] = {}
        self._step_graphs: dict[tuple, _StepGraph] = {}
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
        if any(not 1 <= chunk.num_new_tokens <= self.config.max_tokens_per_sequence for chunk in chunks):
            return None, "chunk_too_long"
        num_tokens = sum(chunk.num_new_tokens for chunk in chunks)
        bucket = self.bucket_for(num_tokens)
        if bucket is None:
            return None, "batch_above_buckets"
        if default_config(num_tokens) != default_config(bucket):  # tile configs must not change with padding
            return None, "bucket_changes_attention_config"
        config = self.side.config
        geometry = None
        max_csa_rows = 0
        for chunk in chunks:
            state = chunk.state
            if state.dtype != self.side.dtype or state.kv_storage is not self.config.kv_storage:
                return None, "state_dtype"
            end = state.num_tokens + chunk.num_new_tokens
            state.reserve_tokens(end)
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
                    if len(ids) * per_block < end // config.compress_ratio(layer):
                        return None, "block_table_too_short"
            if config.csa_compress_ratio:
                max_csa_rows = max(max_csa_rows, end // config.csa_compress_ratio)
        index_rows = index_rows_class(max_csa_rows, config.index_topk) if config.csa_compress_ratio else None
        return (index, bucket, index_rows, geometry), None

    # ------------------------------------------------------------------ the step
    def execute(self, runner, step_id: int, micro_batches: list[tuple[torch.Tensor, list[SequenceChunk]]],
                decode_masks: list[torch.Tensor | None]) -> list[torch.Tensor] | None:
        """Run one step on graphs -> final streams [T_i, N, D] per micro-batch (views of static buffers, valid
        until the next step), advancing the states; None when the step must run eagerly. One replay of a
        whole-step graph when the runner's dispatcher computes every layer here and there is one
        micro-batch, else the runner's loop over segment replays."""
        keys = self.plan(micro_batches)
        if keys is None:
            return None
        if self.config.capture and len(keys) == 1 and runner.dispatcher.device_step_ready(keys[0][1]):
            (token_ids, chunks), = micro_batches
            return [self._replay_step(runner, keys[0], token_ids, chunks, decode_masks[0])]
        return runner.run_segments(step_id, self._segment_runs(keys, micro_batches), decode_masks)

    def _replay_step(self, runner, key: tuple, token_ids: torch.Tensor, chunks: list[SequenceChunk],
                     decode_mask: torch.Tensor | None) -> torch.Tensor:
        dispatcher = runner.dispatcher
        mailboxes = dispatcher.mailbox_plane  # captured steps name the mailboxes' segments: a new one recaptures
        routing_token = (*dispatcher.slot_owners.version_key, runner.capture_layer_ids,
                         None if mailboxes is None else mailboxes.generation)
        step_graph = self._step_graphs.get(key)
        if step_graph is None or step_graph.routing_token != routing_token:
            self._step_graphs.pop(key, None)  # its memory goes back to the pool before the new capture
            step_graph = self._capture_step(runner, key, routing_token)
            self._step_graphs[key] = step_graph
        members = [chunk.state for chunk in chunks]
        counts = [chunk.num_new_tokens for chunk in chunks]
        num_real = sum(counts)  # token rows
        step_graph.graph_set.tables.fill(members, token_ids, self.scratch, counts)
        step_graph.phases[num_real:].fill_(NOT_COUNTED)
        if decode_mask is None:
            step_graph.phases[:num_real].zero_()
        else:
            step_graph.phases[:num_real].copy_(decode_mask)
        step_graph.graph.replay()
        # a mailbox wait that failed in the replay raises after sampling (AttentionWorker: confirm_deferred), so
        # the host samples while the GPU runs; recovery rolls the committed token back like any failed attempt
        dispatcher.confirm_all(defer_mailboxes=True)
        _commit_kernel_writes(chunks)
        runner.captured = [[mean[:num_real] for mean in step_graph.captured]]
        runner.step_logits = step_graph.logits[:num_real]
        num_layers = self.side.config.num_hidden_layers
        runner.stats.num_layer_runs += num_layers
        if dispatcher.every_layer_here():  # every slot computed here (with mailboxes, not counted: no read-back)
            dispatcher.record_local_work(num_real * self.side.config.num_experts_per_tok * num_layers)
        self.stats.num_graph_steps += 1
        self.stats.num_step_graph_steps += 1
        return step_graph.finals[:num_real]

    def _capture_step(self, runner, key: tuple, routing_token: tuple) -> _StepGraph:
        """Capture `runner.run_segments` over the segment functions of a new set of static tables: one
        eager warm-up on a side stream (Triton compiles, workspaces), then the capture. The runner's
        statistics and speculation outputs are restored afterwards (neither run was a real step)."""
        started_s = time.perf_counter()
        graph_set, batch = self._tables_and_segments(key, static_routed=False)
        bucket = key[1]
        phases = torch.full((bucket,), NOT_COUNTED, dtype=torch.long, device=self.device)  # [Tb]
        segment_fns, shared_fns = graph_set.segments.functions()
        run = SegmentRun(graph_set.segments, bucket, segment_fns, shared_fns, finish=lambda: None)
        saved = (dataclasses.replace(runner.stats), runner.captured,
                 list(runner.dispatcher.num_slot_tokens_sent))

        def whole_step() -> tuple[torch.Tensor, torch.Tensor]:
            finals = runner.run_segments(0, [run], [phases])[0]  # [Tb, N, D]
            return finals, self.side.logits(finals)  # [Tb, V]

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            whole_step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        if key[0] not in self._pools:
            self._pools[key[0]] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pools[key[0]], capture_error_mode="thread_local"):
            finals, logits = whole_step()
        captured = runner.captured[0]
        runner.stats, runner.captured, sent_before = saved
        sent = runner.dispatcher.num_slot_tokens_sent  # the warm-up may have grown it (a first step captured)
        sent[:] = sent_before + [0] * (len(sent) - len(sent_before))
        self.stats.num_captures += 1
        log.info("attention.step_graph_captured", micro_batch=key[0], bucket=bucket, index_rows=key[2],
                 paged=key[3][0], num_layers=self.side.config.num_hidden_layers,
                 elapsed_s=round(time.perf_counter() - started_s, 3))
        return _StepGraph(graph_set, phases, finals, logits, captured, routing_token, graph)

    def runs(self, micro_batches: list[tuple[torch.Tensor, list[SequenceChunk]]]) -> list[SegmentRun] | None:
        """One decode step's SegmentRuns (tables filled, segments replayed), or None when it runs eagerly.
        The final streams the runner returns are views of static buffers: valid until the set replays again."""
        keys = self.plan(micro_batches)
        if keys is None:
            return None
        return self._segment_runs(keys, micro_batches)

    def _segment_runs(self, keys: list[tuple], micro_batches: list[tuple[torch.Tensor, list[SequenceChunk]]]
                      ) -> list[SegmentRun]:
        runs = []
        for key, (token_ids, chunks) in zip(keys, micro_batches):
            if key not in self._sets:
                self._sets[key] = self._build(key)  # captured on first use
            graph_set = self._sets[key]
            counts = [chunk.num_new_tokens for chunk in chunks]
            graph_set.tables.fill([chunk.state for chunk in chunks], token_ids, self.scratch, counts)
            runs.append(SegmentRun(graph_set.segments, sum(counts), graph_set.run_segment, graph_set.run_shared,
                                   functools.partial(_commit_kernel_writes, chunks)))
        self.stats.num_graph_steps += 1
        return runs

    # ------------------------------------------------------------------ building sets
    def _tables_and_segments(self, key: tuple, static_routed: bool = True) -> tuple[_GraphSet, GraphBatch]:
        """Static tables of `key` (filled with padding rows only) and the segments over them, not captured.
        static_routed: the routed answers enter through a static buffer (segment graphs read it); False for
        segments captured together in one graph, which take them as they come."""
        _, bucket, index_rows, (paged, rows_per_block) = key
        side = self.side
        rows_per_block = dict(rows_per_block)
        block_width = self.config.max_blocks_per_sequence if paged else 1
        if not paged:
            rows_per_block = {k: CONTIGUOUS_ROWS_PER_BLOCK for k in rows_per_block}
        smaller = [b for b in self.buckets if b < bucket]
        tables = StaticDecodeTables(side.config, bucket, rows_per_block, block_width, index_rows, side.dtype,
                                    self.device, min_real_tokens=(max(smaller) + 1) if smaller else 1,
                                    main_rows=self.scratch.main_row_layout,
                                    indexer_rows=self.scratch.indexer_row_layout)
        routed_in = (torch.zeros(bucket, side.config.hidden_size, dtype=side.dtype, device=self.device)
                     if static_routed else None)  # [Tb, D]
        batch = GraphBatch(tables)
        segments = LayerSegments(side, batch, tables.token_ids, routed_in, keep_layers=True)
        graph_set = _GraphSet(tables, segments)
        tables.fill([], None, self.scratch)  # warm-up and capture over padding rows only
        return graph_set, batch

    def _build(self, key: tuple) -> _GraphSet:
        graph_set, batch = self._tables_and_segments(key)
        segments, bucket, index_rows, paged = graph_set.segments, key[1], key[2], key[3][0]
        if not self.config.capture:
            graph_set.run_segment, graph_set.run_shared = segments.functions()
            return graph_set
        started_s = time.perf_counter()
        if key[0] not in self._pools:
            self._pools[key[0]] = torch.cuda.graph_pool_handle()
        graph_set.run_segment, graph_set.run_shared, graph_set.graphs = capture_segments(
            segments, self._pools[key[0]], self.device)
        self.stats.num_captures += 1
        log.info("attention.graphs_captured", micro_batch=key[0], bucket=bucket, index_rows=index_rows,
                 paged=paged, elapsed_s=round(time.perf_counter() - started_s, 3))
        return graph_set


def _commit_kernel_writes(chunks: list[SequenceChunk]) -> None:
    for chunk in chunks:  # after a replay: the stores advance by the tokens the kernels wrote
        chunk.state.commit_kernel_writes(chunk.num_new_tokens)
