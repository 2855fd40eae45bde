"""The batched (Triton) path of `Attention`: every sequence of the forward in a handful of launches.

Same mathematics as the per-sequence torch path of `common/model/attention.py`, in this order
(each step one launch for the whole batch, through the address tables the ForwardBatch built):
1. compressor (CSA/HCA): its projections (K, Z), with the indexer's and its head weights on CSA layers (one
   launch at decode sizes); then both compressors' rows and rings: at decode sizes one launch
   (`common/kernels/compressor_step.py`), else per compressor: pool the windows this forward closes (old
   inputs from the input rings, new ones from the projections), norm + RoPE at w·m (angles computed in
   that launch; + FP8 QAT when set) over all closed rows at once, write the rows into each sequence's row
   store, then the new inputs into the rings;
2. indexer (CSA): scores of every token against its own sequence's indexer rows and one top-k;
3. sparse attention over window ∪ rows with the sink, the output rotated back in the same launch;
4. the new kv rows into the window rings, after every read of them: at decode sizes by the attention launch's
   last program of each sequence, else a launch after 3 (a long chunk would overwrite rows still read);
5. advance every store's counter (the data was written in place by the kernels).
Only host integers known before the forward steer the launches, so a decode step captures into a
CUDA graph; over per-forward tables those integers (closing-token count, visible-row maxima) depend on
the positions, so a replay is valid only at the captured positions. Over the static tables of
services/attention/graph_tables.py (window closes predicated on the device, split sizes and indexer
width from device memory or a fixed class) the same launches replay at any position.
Legend: T tokens, H heads, hd head dim, Nc rows closed in this forward, C compressor input dim.
"""

from __future__ import annotations

import torch

from moemesh.common.kernels.attention_layout import AttentionTables, Field
from moemesh.common.kernels.compressor_step import CompressorStep, compressor_step
from moemesh.common.kernels.compressor_step import applies as compressor_step_applies
from moemesh.common.kernels.indexer_topk import indexer_topk
from moemesh.common.kernels.kv_write import pool_windows, write_rings, write_rows
from moemesh.common.kernels.sparse_attention import RING_IN_LAUNCH_MAX_TOKENS, sparse_attention
from moemesh.common.model.qat import kv_nope_fp8_qat
from moemesh.common.model.rope import RotaryTable, window_rows_norm_rope


def _record_writes(batch, layer: int, which: str, *tensors: torch.Tensor) -> None:
    """Before the ring writes: stores that record block-end snapshots (prefix cache, swap-in;
    services/attention/boundary.py) see each sequence's new rows while they are all still at hand."""
    for chunk, rows in _chunks_crossing_block_ends(batch):
        store = getattr(chunk.state.layers[layer], which)
        store.record_write(*(tensor[rows] for tensor in tensors))


def _chunks_crossing_block_ends(batch) -> list:
    """(chunk, token slice) of the sequences whose new tokens cross a KV block end in a recording
    state, found once per forward (every layer has the same positions; the sequence's own count
    advances only after the forward), so a forward that crosses none costs one check per sequence, not per layer and store.
    A CUDA-graph capture has no chunks (commit_kernel_writes records after each replay)."""
    if not batch.chunks:
        return []
    found = getattr(batch, "_chunks_crossing_block_ends", None)
    if found is None:
        found = []
        for chunk, rows in zip(batch.chunks, batch.slices):
            start = chunk.state.num_tokens
            recorder = getattr(chunk.state.layers[0].window, "recorder", None)
            if recorder is not None and recorder.boundaries(start, start + chunk.num_new_tokens):
                found.append((chunk, rows))
        batch._chunks_crossing_block_ends = found
    return found


def _emit_rows(compressor, kv_in: torch.Tensor, score_in: torch.Tensor, tables: AttentionTables, layer: int,
               rope: RotaryTable, *, indexer: bool) -> None:
    """Step 1/2: close this forward's windows of one compressor and store rows and inputs."""
    ratio = compressor.ratio
    ring_like = kv_in.new_empty(0, dtype=torch.float32)
    pooled = pool_windows(kv_in, score_in, tables, layer, ratio=ratio, overlap=compressor.overlap,
                          row_dim=compressor.row_dim, indexer=indexer)  # [Nc, d] fp32
    if pooled.shape[0]:
        closing, _ = tables.closing_tokens(ratio)
        rows = window_rows_norm_rope(pooled, compressor.norm.weight, compressor.norm.eps, rope, tables.positions,
                                     closing, ratio, kv_in.dtype)  # [Nc, d], rotated at each window's start
        if compressor.fp8_qat_nope_dim is not None:
            rows = kv_nope_fp8_qat(rows, compressor.fp8_qat_nope_dim, compressor.fp8_qat_block_size)
        write_rows(rows, rows.new_empty(0, dtype=tables.state_dtype), tables, layer, ratio=ratio, indexer=indexer)
    kv_field, score_field, ring_field = (
        (Field.INDEX_INPUT_KV_ADDR, Field.INDEX_INPUT_SCORE_ADDR, Field.INDEX_INPUT_RING) if indexer else
        (Field.INPUT_KV_ADDR, Field.INPUT_SCORE_ADDR, Field.INPUT_RING))
    write_rings(kv_in, ring_like, tables, layer, kv_field, ring_field, second=(score_in, score_field))


def _step(compressor, kv_in: torch.Tensor, score_in: torch.Tensor, *, indexer: bool) -> CompressorStep:
    return CompressorStep(kv_in, score_in, compressor.norm.weight, compressor.norm.eps, compressor.ratio,
                          compressor.overlap, compressor.row_dim, indexer)


def batched_attention_core(attn, batch, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, q_lat: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [T, H, hd], kv [T, hd] (normed, rotated), x [T, D], q_lat [T, R] -> attention output
    [T, H, hd], its rotary channels rotated back in the attention launch; updates every sequence's stores of
    this layer."""
    tables: AttentionTables = batch.attention_tables
    layer = attn.layer
    ratio = 0
    topk_ids = None
    if attn.indexer is not None:  # the layer's compressor, the indexer's and its head weights: one projection launch
        kv_in, score_in, ikv_in, iscore_in, head_weights = attn.indexer.project_inputs(x, batch.positions,
                                                                                       attn.compressor)
    elif attn.compressor is not None:
        kv_in, score_in = attn.compressor.project(x, batch.positions)
    if attn.compressor is not None:
        ratio = attn.compressor.ratio
        _record_writes(batch, layer, "compressor", kv_in, score_in)
        steps = [_step(attn.compressor, kv_in, score_in, indexer=False)]
    if attn.indexer is not None:
        _record_writes(batch, layer, "indexer", ikv_in, iscore_in)
        steps.append(_step(attn.indexer.compressor, ikv_in, iscore_in, indexer=True))
    if attn.compressor is not None:
        indexer_qat = attn.indexer is not None and attn.indexer.compressor.fp8_qat_nope_dim is not None
        if compressor_step_applies(tables, x.shape[0], attn.compressor.fp8_qat_nope_dim is not None, indexer_qat):
            compressor_step(tuple(steps), tables, layer, attn.rope.inv_freq)
        else:
            for step, compressor in zip(steps, (attn.compressor, attn.indexer and attn.indexer.compressor)):
                _emit_rows(compressor, step.kv, step.score, tables, layer, attn.rope, indexer=step.indexer)
    if attn.indexer is not None:
        if tables.max_rows_visible(ratio) > attn.indexer.topk:  # else every visible row is attended
            queries = attn.indexer.rotated_queries(q_lat, cos, sin)
            topk_ids = indexer_topk(queries.to(tables.state_dtype), head_weights, tables, layer, ratio=ratio,
                                    topk=attn.indexer.topk)
        else:
            topk_ids = q.new_empty(q.shape[0], attn.indexer.topk, dtype=torch.int64)
    _record_writes(batch, layer, "window", kv)
    ring_in_launch = x.shape[0] <= RING_IN_LAUNCH_MAX_TOKENS  # decode sizes: the attention launch writes the rings
    out = sparse_attention(q, kv, attn.attn_sink, attn.scale, tables, layer, window=attn.config.sliding_window,
                           ratio=ratio, topk_ids=topk_ids, rotate_back=(cos, sin), write_ring=ring_in_launch)
    if not ring_in_launch:
        write_rings(kv, kv, tables, layer, Field.WINDOW_ADDR, Field.WINDOW_RING)
    for chunk in batch.chunks:
        layer_state = chunk.state.layers[layer]
        for store in layer_state.stores():
            store.mark_written(chunk.num_new_tokens)
    return out


def can_use_kernels(batch, kv: torch.Tensor) -> bool:
    """The batched path needs tables, rows in the stores' dtype and no autograd (no backward)."""
    tables = batch.attention_tables
    if tables is None or kv.dtype != tables.state_dtype:
        return False
    return not (torch.is_grad_enabled() and kv.requires_grad)
