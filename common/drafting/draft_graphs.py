"""CUDA graphs of the drafter's block forward, by drafted-request bucket.

Eagerly, one draft of the DSpark drafter is thousands of small launches (the stages' projections, mHC
mixing, attention over the ring, the routed experts, the head, then the Markov chain slot by slot), and
on a GPU the host issuing them is the draft's cost, not the bytes. `DraftGraphs` captures all of it once
per bucket of drafted requests A_b (1, 2, 4, ...) over fixed shapes: every request's context padded to the
ring capacity C (positions past its ring are masked out, as eagerly past the longest ring), the block of G
slots, and the Markov chains of every row: greedy rows take the argmax (`chains.greedy_slot`, the very
function `batched_chains` runs), sampled rows draw from their sparse q at their temperature with the
key-derived exponential race (`chains.sparse_slot_draw`, on CUDA its two-launch kernel
common/kernels/draft_support.py; keys `chains.draft_keys` computed on the host and copied in, every slot's
Exp(1) draws computed from them at once), as `batched_chains` does. A draft is then a copy of each ring into the graph's static context
buffer, one copy of the integer inputs (positions, block, keys: one flat table), one replay and one transfer
of (tokens, probabilities, confidences), plus the supports of the sampled rows. Without a support cap (max_support None: the dense q and a generator per draw) sampled rows
draw eagerly from the replay's logits. The padding rows of a bucket see no context and cost a few idle
rows of the same launches.
Only a bf16/fp16 drafter is captured (`capturable`): in float32 its experts group tokens on the host.

Graphs are captured lazily per (bucket, whether any row samples): a batch of greedy rows replays a graph
without the supports. One eager warm-up on a side stream comes first (Triton compiles and workspaces);
all graphs share one memory pool (a draft replays exactly one of them). The stages' RoPE frequencies move
to the device first (no host-to-device copy inside a capture). Legend: A drafted requests, A_b bucket,
C ring capacity, G block slots, D hidden, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from moemesh.common.drafting.chains import greedy_slot, sparse_slot_draw
from moemesh.common.kernels.draft_support import sparse_slot_draw_kernel
from moemesh.common.model.dspark import DSparkDrafter
from moemesh.common.sampling.rng import key_exponentials

log = structlog.get_logger("draft")

DEFAULT_DRAFT_BUCKETS = (1, 2, 4, 8, 16)


@dataclass
class DraftGraphOutputs:
    """Views of one replay's static outputs (valid until the next replay): hidden [A, G, D] (pre-norm),
    base_logits [A, G, V]; chains [A, G, 3] fp32 (token id, its probability: at temperature 1 for greedy rows,
    q for sampled rows; confidence); support_ids / support_probs [A, G, K] every slot's sparse q (None without
    a support cap: then only the greedy rows' chains are valid)."""

    hidden: torch.Tensor
    base_logits: torch.Tensor
    chains: torch.Tensor
    support_ids: torch.Tensor | None
    support_probs: torch.Tensor | None


@dataclass
class _BucketGraph:
    """One bucket's static buffers. The integer inputs share one flat int64 buffer `tables` (one host-to-device
    copy a draft), each region a contiguous [A_b, .] view: context positions (-1 where a row has no context
    entry: the graph derives the mask from it), block token ids, block positions, DRAFT keys."""

    main_x: torch.Tensor  # [A_b, C, D]
    tables: torch.Tensor  # [A_b·C + 3·A_b·G] int64, the views below
    context_positions: torch.Tensor  # [A_b, C] int64, -1: no entry
    block_token_ids: torch.Tensor  # [A_b, G] int64
    block_positions: torch.Tensor  # [A_b, G] int64
    keys: torch.Tensor  # [A_b, G] int64 DRAFT keys of the sampled rows' slots
    temperatures: torch.Tensor  # [A_b] fp32, 0: greedy row
    outputs: DraftGraphOutputs | None = None  # over A_b rows, written by every replay
    graph: Any = None


def _table_views(tables: torch.Tensor, bucket: int, context_len: int, num_slots: int) -> tuple[torch.Tensor, ...]:
    """(context positions [A_b, C], block token ids, block positions, keys [A_b, G]) over a flat table."""
    sizes = (bucket * context_len, bucket * num_slots, bucket * num_slots, bucket * num_slots)
    parts = torch.split(tables, sizes)
    return (parts[0].view(bucket, context_len), *(part.view(bucket, num_slots) for part in parts[1:]))


class DraftGraphs:
    """The drafter's captured block forwards (see the module docstring). context_len: the ring capacity C;
    max_support: the sampled rows' support cap K (None: sampled chains are drawn eagerly); capture: False runs
    the same work over the same static buffers without a graph (the CPU tests of the padding and the chains)."""

    def __init__(self, drafter: DSparkDrafter, context_len: int, max_support: int | None,
                 buckets: tuple[int, ...] = DEFAULT_DRAFT_BUCKETS, capture: bool = True) -> None:
        self.drafter = drafter
        self.device = drafter.head.weight.device
        self.capture = capture
        if capture and not self.capturable(drafter):
            raise ValueError(f"DraftGraphs needs a bf16/fp16 drafter on CUDA, not {drafter.dtype} on {self.device}")
        self.context_len = context_len
        vocab_size = drafter.config.vocab_size
        self.support_k = None if max_support is None or max_support >= vocab_size else max_support
        self.buckets = tuple(sorted(buckets))
        self._graphs: dict[tuple[int, bool], _BucketGraph] = {}  # (bucket, sampled rows drawn in the graph)
        self._pool = None
        self.num_replays = 0
        for stage in drafter.mtp:  # cos/sin computed in the graph from device frequencies (a no-op on the CPU)
            stage.attn.rope = stage.attn.rope.to(self.device)

    @staticmethod
    def capturable(drafter: DSparkDrafter) -> bool:
        """On CUDA in bf16/fp16 the stages' routed experts run the grouped kernels, which never wait on the host;
        in float32 they group tokens per expert on the host (`torch.unique`), which a capture forbids."""
        return drafter.head.weight.device.type == "cuda" and drafter.dtype in (torch.bfloat16, torch.float16)

    def bucket_for(self, num_requests: int) -> int | None:
        return next((bucket for bucket in self.buckets if bucket >= num_requests), None)

    def run(self, contexts: list[tuple[torch.Tensor, torch.Tensor]], seed_token_ids: list[int],
            seed_positions: list[int], temperatures: list[float], keys: torch.Tensor | None
            ) -> DraftGraphOutputs | None:
        """One replay for A requests, or None when A is above the largest bucket or a context above the capacity
        (the caller runs eagerly). contexts: each request's ring, oldest first (main_x [c, D] on the device,
        positions [c] int64 on the host); its seed token and the seed's position; every row's temperature (0:
        greedy); the sampled rows' DRAFT keys [A, G] int64 on the host (`chains.draft_keys`; None when no row
        samples). The features go straight into the static buffer, the integer inputs in one copy."""
        num_requests = len(contexts)
        bucket = self.bucket_for(num_requests)
        if bucket is None or any(features.shape[0] > self.context_len for features, _ in contexts):
            return None
        sampled = keys is not None and self.support_k is not None
        entry = self._graphs.get((bucket, sampled))
        if entry is None:
            entry = self._graphs[(bucket, sampled)] = self._capture(bucket, sampled)
        num_slots = self.drafter.dspark.block_size
        host = torch.empty(entry.tables.shape, dtype=torch.int64)
        positions, block_ids, block_positions, host_keys = _table_views(host, bucket, self.context_len, num_slots)
        positions.fill_(-1)
        block_ids.fill_(self.drafter.dspark.noise_token_id)
        block_ids[:num_requests, 0] = torch.tensor(seed_token_ids, dtype=torch.int64)
        block_positions.copy_(torch.arange(num_slots, dtype=torch.int64).expand(bucket, num_slots))
        block_positions[:num_requests] += torch.tensor(seed_positions, dtype=torch.int64)[:, None]
        host_keys.zero_()
        if sampled:
            host_keys[:num_requests] = keys
        for row, (features, context_positions) in enumerate(contexts):
            count = features.shape[0]
            positions[row, :count] = context_positions
            entry.main_x[row, :count].copy_(features)  # past count: stale rows, masked out
        entry.tables.copy_(host)
        if sampled:
            entry.temperatures.copy_(torch.tensor(temperatures + [0.0] * (bucket - num_requests), dtype=torch.float32))
        if self.capture:
            entry.graph.replay()
        else:
            self._forward(entry, sampled)
        self.num_replays += 1
        out = entry.outputs
        return DraftGraphOutputs(out.hidden[:num_requests], out.base_logits[:num_requests], out.chains[:num_requests],
                                 None if out.support_ids is None else out.support_ids[:num_requests],
                                 None if out.support_probs is None else out.support_probs[:num_requests])

    def _forward(self, entry: _BucketGraph, sampled: bool) -> None:
        """The captured work (`block_chains` over the entry's static inputs, outputs kept in the entry)."""
        valid = entry.context_positions >= 0  # [A_b, C]
        entry.outputs = block_chains(self.drafter, entry.main_x, entry.context_positions.clamp_min(0), valid,
                                     entry.block_token_ids, entry.block_positions, entry.temperatures, entry.keys,
                                     self.support_k if sampled else None)

    def _capture(self, bucket: int, sampled: bool) -> _BucketGraph:
        started_s = time.perf_counter()
        drafter, device = self.drafter, self.device
        num_slots = drafter.dspark.block_size
        context_len = self.context_len
        tables = torch.empty(bucket * (context_len + 3 * num_slots), dtype=torch.int64, device=device)
        positions, block_ids, block_positions, keys = _table_views(tables, bucket, context_len, num_slots)
        positions.fill_(-1)
        block_ids.fill_(drafter.dspark.noise_token_id)
        block_positions.copy_(torch.arange(num_slots, dtype=torch.long, device=device).expand(bucket, num_slots))
        keys.zero_()
        entry = _BucketGraph(
            main_x=torch.zeros(bucket, context_len, drafter.config.hidden_size, dtype=drafter.dtype, device=device),
            tables=tables, context_positions=positions, block_token_ids=block_ids, block_positions=block_positions,
            keys=keys, temperatures=torch.zeros(bucket, dtype=torch.float32, device=device))
        if not self.capture:
            return entry
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            self._forward(entry, sampled)  # compiles and workspaces outside the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        entry.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(entry.graph, pool=self._pool, capture_error_mode="thread_local"):
            self._forward(entry, sampled)
        log.info("draft.graph_captured", bucket=bucket, sampled=sampled, context_len=self.context_len,
                 block_size=num_slots,
                 elapsed_s=round(time.perf_counter() - started_s, 3))
        return entry


def block_chains(drafter: DSparkDrafter, main_x: torch.Tensor, context_positions: torch.Tensor,
                 context_valid: torch.Tensor, block_token_ids: torch.Tensor, block_positions: torch.Tensor,
                 temperatures: torch.Tensor, keys: torch.Tensor, support_k: int | None) -> DraftGraphOutputs:
    """What a drafter graph computes, as plain tensor code (captured on CUDA; the CPU tests run it as is):
    `block_hidden`, the base logits and every row's chain. temperatures [A] fp32 (0: greedy row), keys [A, G]
    int64 (the sampled rows' DRAFT keys); support_k: the sampled rows draw from their top-k sparse q (None:
    greedy chains only, no supports). Shapes as `DraftGraphOutputs`."""
    hidden = drafter.block_hidden(main_x, context_positions, context_valid, block_token_ids,
                                  block_positions)  # [A, G, D]
    base_logits = drafter.base_logits(hidden)  # [A, G, V]
    prev = block_token_ids[:, 0]  # [A]: the seeds
    is_sampled = temperatures > 0  # [A]
    divisors = torch.where(is_sampled, temperatures, 1.0)[:, None]  # [A, 1]
    noise = None if support_k is None else key_exponentials(keys, support_k)  # [A, G, K]: every slot's draws
    slot_draw = sparse_slot_draw_kernel if base_logits.is_cuda else sparse_slot_draw  # same ids, same draws
    slots, support_ids, support_probs = [], [], []
    for k in range(hidden.shape[1]):
        token, chosen, confidence, logits = greedy_slot(drafter, base_logits[:, k], hidden[:, k], prev)
        if support_k is not None:  # every row's sparse q [A, K]; the sampled rows draw from theirs
            ids, values, drawn, drawn_q = slot_draw(logits, divisors, noise[:, k], support_k)
            token = torch.where(is_sampled, drawn, token)
            chosen = torch.where(is_sampled, drawn_q, chosen)
            support_ids.append(ids)
            support_probs.append(values)
        slots.append(torch.stack([token.float(), chosen.float(), confidence.float()], dim=-1))  # [A, 3]
        prev = token
    return DraftGraphOutputs(hidden, base_logits, torch.stack(slots, dim=1),
                             torch.stack(support_ids, dim=1) if support_ids else None,
                             torch.stack(support_probs, dim=1) if support_probs else None)
