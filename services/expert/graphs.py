"""CUDA graphs of the expert worker's per-layer work, by token-count bucket.

One Dispatch of a stacked holder (`QuantizedRoutedExperts`) is about ten launches (sort by expert,
searchsorted offsets, gather, grouped gate-up, grouped down, scatter, mask, slot sum); eagerly their
host cost (~10 us each from Python) exceeds the device time at decode sizes. `ExpertGraphs.run`
copies the Dispatch into static buffers of the smallest bucket that holds it, pads the rest (expert
0 with route weight 0 and a False mask: padded rows produce zeros and are never read), replays the
graph captured for (layer, bucket, mask given, per-expert outputs) and returns a view of the static
output. Captured lazily on first use (one eager warm-up run first, so Triton compiles outside the
capture). Shapes above the largest bucket, layers whose experts are not all held here (the held
check needs a host sync, which a capture forbids) and CPU devices run eagerly (`run` returns None).

Why padded outputs equal the eager ones: the grouped kernels compute every row independently (a row
is one M index; the K loop order depends only on the tile config, which depends on rows per expert,
the same decode regime for every bucket up to 64 tokens x 6 slots / 256 experts), and padded rows
only join expert 0's group. The CUDA test compares graph and eager outputs bit for bit.
The returned tensor is the graph's static output: valid until the next `run` of the same entry
(the worker copies it into the reply staging or the CUDA IPC ring before handling the next message).
Legend: T tokens, Tb bucket tokens, K top-k, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from moemesh.common.kernels.moe_layout import sum_slots_in_order
from moemesh.common.model.step_graphs import DECODE_GRAPH_BUCKETS

log = structlog.get_logger("expert")

DEFAULT_BUCKETS = DECODE_GRAPH_BUCKETS


@dataclass(frozen=True)
class ExpertGraphConfig:
    """buckets: token counts graphs are captured for, ascending (empty: graphs off)."""

    buckets: tuple[int, ...] = DEFAULT_BUCKETS


@dataclass
class _Entry:
    graph: Any
    hidden: torch.Tensor  # [Tb, D]
    ids: torch.Tensor  # [Tb, K] int64
    weights: torch.Tensor  # [Tb, K] f32
    mask: torch.Tensor | None  # [Tb, K] bool
    output: torch.Tensor  # [Tb, D] or [Tb, K, D]


@dataclass
class GraphStats:
    num_replays: int = 0
    num_eager: int = 0
    num_captures: int = 0
    captured: list[tuple[int, int, bool, bool]] = field(default_factory=list)


class ExpertGraphs:
    def __init__(self, holder: Any, config: ExpertGraphConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.holder = holder
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.buckets = tuple(sorted(config.buckets))
        self._entries: dict[tuple[int, int, bool, bool], _Entry] = {}
        self._holds_all: dict[int, bool] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" and self.buckets else None
        self.stats = GraphStats()

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((bucket for bucket in self.buckets if bucket >= num_tokens), None)

    def _layer_holds_all(self, layer: int) -> bool:
        if layer not in self._holds_all:
            held = [e for held_layer, e in self.holder.pairs if held_layer == layer]
            self._holds_all[layer] = len(held) == self.holder.num_routed_experts
        return self._holds_all[layer]

    def run(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            mask: torch.Tensor | None, per_expert_outputs: bool) -> torch.Tensor | None:
        """hidden [T, D], ids [T, K], weights [T, K], mask [T, K] or None -> output [T, D] (or [T, K, D])
        from a graph replay, or None when this Dispatch must run eagerly."""
        bucket = self.bucket_for(hidden.shape[0])
        if self._pool is None or bucket is None or not hidden.is_cuda or not self._layer_holds_all(layer):
            self.stats.num_eager += 1
            return None
        key = (layer, bucket, mask is not None, per_expert_outputs)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._capture(key, hidden.shape[1], ids.shape[1])
        num_tokens = hidden.shape[0]
        entry.hidden[:num_tokens].copy_(hidden)
        entry.ids[:num_tokens].copy_(ids)
        entry.weights[:num_tokens].copy_(weights)
        if num_tokens < bucket:  # padded rows: expert 0, weight 0 (zeros out, never read)
            entry.ids[num_tokens:].zero_()
            entry.weights[num_tokens:].zero_()
        if entry.mask is not None:
            entry.mask[:num_tokens].copy_(mask)
            entry.mask[num_tokens:].fill_(False)
        entry.graph.replay()
        self.stats.num_replays += 1
        return entry.output[:num_tokens]

    def _compute(self, layer: int, entry_hidden, entry_ids, entry_weights, entry_mask, per_expert_outputs: bool):
        per_slot = self.holder.per_expert_outputs(layer, entry_hidden, entry_ids, entry_weights)  # [Tb, K, D]
        if entry_mask is not None:
            per_slot = per_slot * entry_mask[..., None].to(per_slot.dtype)
        return per_slot if per_expert_outputs else sum_slots_in_order(per_slot)

    def _capture(self, key: tuple[int, int, bool, bool], hidden_size: int, top_k: int) -> _Entry:
        layer, bucket, has_mask, per_expert_outputs = key
        hidden = torch.zeros(bucket, hidden_size, dtype=self.dtype, device=self.device)
        ids = torch.zeros(bucket, top_k, dtype=torch.int64, device=self.device)
        weights = torch.zeros(bucket, top_k, dtype=torch.float32, device=self.device)
        mask = torch.zeros(bucket, top_k, dtype=torch.bool, device=self.device) if has_mask else None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the capture: Triton compiles, workspaces
            self._compute(layer, hidden, ids, weights, mask, per_expert_outputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._compute(layer, hidden, ids, weights, mask, per_expert_outputs)
        entry = _Entry(graph, hidden, ids, weights, mask, output)
        self._entries[key] = entry
        self.stats.num_captures += 1
        self.stats.captured.append(key)
        log.debug("expert.graph_captured", layer=layer, bucket=bucket, has_mask=has_mask,
                  per_expert_outputs=per_expert_outputs)
        return entry
