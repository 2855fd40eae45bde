"""CUDA graphs of the drafter's block forward, by drafted-request bucket.

Eagerly, one draft of the DSpark drafter is thousands of small launches (the stages' projections, mHC
mixing, attention over the ring, the routed experts, the head, then the Markov chain slot by slot), and
on a GPU the host issuing them is the draft's cost, not the bytes. `DraftGraphs` captures all of it once
per bucket of drafted requests A_b (1, 2, 4, ...) over fixed shapes: every request's context padded to the
ring capacity C (positions past its ring are masked out, as eagerly past the longest ring), the block of G
slots, and the Markov chains of every row: greedy rows take the argmax (`chains.greedy_slot`, the very
function `batched_chains` runs), sampled rows draw from their sparse q at their temperature with the
key-derived exponential race (`chains.support_draw`, keys `chains.draft_keys` computed on the host and
copied in), as `batched_chains` does. A draft is then one copy of the padded inputs into the graph's static
buffers, one replay and one transfer of (tokens, probabilities, confidences), plus the supports of the
sampled rows. Without a support cap (max_support None: the dense q and a generator per draw) sampled rows
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
from moemesh.common.model.dspark import DSparkDrafter

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
    main_x: torch.Tensor  # [A_b, C, D]
    context_positions: torch.Tensor  # [A_b, C] int64
    context_valid: torch.Tensor  # [A_b, C] bool
    block_token_ids: torch.Tensor  # [A_b, G] int64
    block_positions: torch.Tensor  # [A_b, G] int64
    temperatures: torch.Tensor  # [A_b] fp32, 0: greedy row
    keys: torch.Tensor  # [A_b, G] int64 DRAFT keys of the sampled rows' slots
    outputs: DraftGraphOutputs | None = None  # over A_b rows, written by every replay
    graph: Any = None


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

    def run(self, main_x: torch.Tensor, context_positions: torch.Tensor, context_valid: torch.Tensor,
            block_token_ids: torch.Tensor, block_positions: torch.Tensor, temperatures: list[float],
            keys: torch.Tensor | None) -> DraftGraphOutputs | None:
        """The eager `block_hidden` inputs (main_x [A, c, D] with c <= C, ...), every row's temperature (0:
        greedy) and the sampled rows' DRAFT keys [A, G] int64 (`chains.draft_keys`; None when no row samples)
        -> one replay's outputs for the A requests; None when A is above the largest bucket or c above the
        capacity (the caller runs eagerly)."""
        num_requests, num_context = context_valid.shape
        bucket = self.bucket_for(num_requests)
        if bucket is None or num_context > self.context_len:
            return None
        sampled = keys is not None and self.support_k is not None
        entry = self._graphs.get((bucket, sampled))
        if entry is None:
            entry = self._graphs[(bucket, sampled)] = self._capture(bucket, sampled)
        entry.context_valid.zero_()
        entry.main_x[:num_requests, :num_context].copy_(main_x)
        entry.context_positions[:num_requests, :num_context].copy_(context_positions)
        entry.context_valid[:num_requests, :num_context].copy_(context_valid)
        entry.block_token_ids[:num_requests].copy_(block_token_ids)
        entry.block_positions[:num_requests].copy_(block_positions)
        entry.temperatures[:num_requests].copy_(torch.tensor(temperatures, dtype=torch.float32), non_blocking=True)
        if sampled:
            entry.keys[:num_requests].copy_(keys)
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
        entry.outputs = block_chains(self.drafter, entry.main_x, entry.context_positions, entry.context_valid,
                                     entry.block_token_ids, entry.block_positions, entry.temperatures, entry.keys,
                                     self.support_k if sampled else None)

    def _capture(self, bucket: int, sampled: bool) -> _BucketGraph:
        started_s = time.perf_counter()
        drafter, device = self.drafter, self.device
        num_slots = drafter.dspark.block_size
        entry = _BucketGraph(
            main_x=torch.zeros(bucket, self.context_len, drafter.config.hidden_size, dtype=drafter.dtype,
                               device=device),
            context_positions=torch.zeros(bucket, self.context_len, dtype=torch.long, device=device),
            context_valid=torch.zeros(bucket, self.context_len, dtype=torch.bool, device=device),
            block_token_ids=drafter.block_inputs(torch.zeros(bucket, dtype=torch.long, device=device)),
            block_positions=torch.arange(num_slots, dtype=torch.long, device=device).repeat(bucket, 1),
            temperatures=torch.zeros(bucket, dtype=torch.float32, device=device),
            keys=torch.zeros(bucket, num_slots, dtype=torch.int64, device=device))
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
    slots, support_ids, support_probs = [], [], []
    for k in range(hidden.shape[1]):
        token, chosen, confidence, logits = greedy_slot(drafter, base_logits[:, k], hidden[:, k], prev)
        if support_k is not None:  # every row's sparse q [A, K]; the sampled rows draw from theirs
            ids, values, drawn, drawn_q = sparse_slot_draw(logits, divisors, keys[:, k], support_k)
            token = torch.where(is_sampled, drawn, token)
            chosen = torch.where(is_sampled, drawn_q, chosen)
            support_ids.append(ids)
            support_probs.append(values)
        slots.append(torch.stack([token.float(), chosen.float(), confidence.float()], dim=-1))  # [A, 3]
        prev = token
    return DraftGraphOutputs(hidden, base_logits, torch.stack(slots, dim=1),
                             torch.stack(support_ids, dim=1) if support_ids else None,
                             torch.stack(support_probs, dim=1) if support_probs else None)
