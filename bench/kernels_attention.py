"""Batched attention kernels at V4-Flash sizes: kernel time vs the torch path and vs the floor.

Usage: python -m moemesh.bench.kernels_attention [--out-dir DIR] [--quick] [--batch 1,8,64] [--prefill 2048,8192]

For one CSA and one HCA layer (random bf16 weights, true width) it measures, on the same device:
- ceilings: copy bandwidth (bytes read + written) and bf16 matmul rate (bench.kernels);
- decode (4K-token random history per sequence, B sequences, one token each): the sparse attention
  kernel alone per tile config (window 128 + CSA top-512 / HCA all closed rows, sink), the
  indexer scores + top-k alone, and the whole attention layer (projections, compressor, indexer,
  core, state writes) through the kernel path and through the per-sequence torch path; decode
  timings are CUDA-graph replays (host launch cost excluded), medians;
- prefill (one sequence, S new tokens in one forward): the sparse attention kernel per config,
  the indexer, and the whole layer through both paths (eager, events).
Floors: decode = KV bytes the core must read (window + picked rows, and for the indexer its rows)
plus q and out / copy bandwidth; prefill = core FLOPs (4·H·hd per visible key per token) /
bf16 rate. Writes `kernels-attention-*.json` via bench.results_io.
Legend: B sequences, S prefill tokens, H heads, hd head dim.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from moemesh.bench.timing import floor_ratio, floor_s, graph_median_s, median, time_s

CONTEXT_TOKENS = 4096
# (block_h, block_n, warps, stages); the first is the default (common.kernels.sparse_attention).
# sm_90 compiles (bench.attention_sass, after removing per-element 64-bit divisions):
# h32n32w8 181 regs (s1) / 196 (s2, cp.async), h16n32w8s2 151, no spills; h64 255 regs, 8-56 bytes spilled.
DECODE_CONFIGS = ((16, 32, 8, 2, None), (16, 32, 8, 2, 4), (16, 16, 4, 2, None), (32, 32, 8, 1, None),
                  (32, 32, 8, 2, None), (64, 16, 8, 2, None))  # (..., key splits: None = auto)
PREFILL_CONFIGS = ((64, 32, 8, 1, None), (32, 32, 8, 2, None), (64, 16, 8, 1, None), (64, 32, 8, 2, None))


def _graph_time(fn, num_replays: int = 20) -> float:
    """Median device seconds of `fn` captured in a CUDA graph."""
    return graph_median_s([fn], replays=num_replays)


def _event_time(fn, reps: int = 3) -> float:
    """Median seconds of `fn` over `reps` runs timed with CUDA events, after one warm-up run
    (compiles, allocations) that is waited for."""
    return median(time_s(fn, "cuda", warmup=1, repeats=reps))


def _layer_setup(kind):
    import torch

    from moemesh.bench.checks.attention import random_layers
    from moemesh.common.model.random_init import flash_config

    config = flash_config((kind,))
    layer = random_layers(config, torch.bfloat16, "cuda", seed=1)[0]
    return config, layer


def _decode_layer_time(layer, config, states, backend) -> float:
    """One decode step of the whole attention layer, captured (state counters rolled back after)."""
    import torch

    from moemesh.common.model.batch import ForwardBatch, SequenceChunk

    x = torch.randn(len(states), config.hidden_size, device="cuda", dtype=torch.bfloat16)
    batch = ForwardBatch([SequenceChunk(s, 1) for s in states], "cuda", attention_backend=backend)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, batch)  # warm-up (compilation), then undo its counters
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for state in states:
        for store in state.layers[0].stores():
            store.rollback(1)
    batch = ForwardBatch([SequenceChunk(s, 1) for s in states], "cuda", attention_backend=backend)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, batch)
    samples = time_s(graph.replay, "cuda", repeats=20)
    del graph
    for state in states:
        for store in state.layers[0].stores():
            store.rollback(1)
    return median(samples)


def bench_decode(kind_name: str, batch_size: int, ceilings: dict, quick: bool) -> dict:
    import torch

    from moemesh.common.kernels.indexer_topk import indexer_scores, indexer_topk
    from moemesh.common.kernels.sparse_attention import sparse_attention
    from moemesh.common.kernels.sparse_attention_plan import SparseAttentionConfig
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import fill_random_context, new_sequence_state

    kind = AttentionKind.CSA if kind_name == "csa" else AttentionKind.HCA
    config, layer = _layer_setup(kind)
    generator = torch.Generator(device="cuda").manual_seed(0)
    states = []
    for _ in range(batch_size):
        state = new_sequence_state(config, CONTEXT_TOKENS + 64, torch.bfloat16, "cuda")
        fill_random_context(state, CONTEXT_TOKENS, generator=generator)
        states.append(state)
    heads, head_dim, ratio = config.num_attention_heads, config.head_dim, config.compress_ratio(0)
    batch = ForwardBatch([SequenceChunk(s, 1) for s in states], "cuda", attention_backend=AttentionBackend.TRITON)
    tables = batch.attention_tables
    q = torch.randn(batch_size, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(batch_size, head_dim, device="cuda", dtype=torch.bfloat16)
    visible_rows = (CONTEXT_TOKENS + 1) // ratio
    topk_ids = None
    num_rows = visible_rows
    if kind is AttentionKind.CSA:
        num_rows = min(config.index_topk, visible_rows)
        topk_ids = torch.rand(batch_size, visible_rows, device="cuda").argsort(dim=1)[:, :num_rows].to(torch.int32)
    keys = config.sliding_window + num_rows
    kv_bytes = batch_size * (keys * head_dim * 2 + 2 * heads * head_dim * 2)
    index_bytes = batch_size * visible_rows * config.index_head_dim * 2 if kind is AttentionKind.CSA else 0
    row = {"kind": kind_name, "batch": batch_size, "context": CONTEXT_TOKENS, "keys_per_token": keys,
           "core_bytes": kv_bytes, "core_floor_s": floor_s(kv_bytes, ceilings["copy_bytes_per_s"]), "configs": {}}
    for block_h, block_n, warps, stages, splits in DECODE_CONFIGS[:3] if quick else DECODE_CONFIGS:
        cfg = SparseAttentionConfig(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages,
                                    num_splits=splits)
        name = f"h{block_h}_n{block_n}_w{warps}_s{stages}" + (f"_k{splits}" if splits else "")
        try:
            seconds = _graph_time(lambda: sparse_attention(q, kv, layer.attn_sink, layer.scale, tables, 0,
                                                           window=config.sliding_window, ratio=ratio,
                                                           topk_ids=topk_ids, config=cfg))
            row["configs"][name] = seconds
        except Exception as error:  # noqa: BLE001 - a failing config is a result, not the end of the run
            row["configs"][name] = f"error: {error!r}"[:300]
    times = [v for v in row["configs"].values() if isinstance(v, float)]
    if times:
        row["core_best_s"] = min(times)
        row["core_best_vs_floor"] = floor_ratio(min(times), row["core_floor_s"])
    if kind is AttentionKind.CSA:
        queries = torch.randn(batch_size, config.index_n_heads, config.index_head_dim, device="cuda",
                              dtype=torch.bfloat16)
        weights = torch.randn(batch_size, config.index_n_heads, device="cuda")
        row["indexer_s"] = _graph_time(lambda: indexer_topk(queries, weights, tables, 0, ratio=ratio,
                                                            topk=config.index_topk))
        row["indexer_scores_s"] = _graph_time(lambda: indexer_scores(queries, weights, tables, 0, ratio=ratio))
        row["indexer_floor_s"] = floor_s(index_bytes, ceilings["copy_bytes_per_s"])
    for backend in (AttentionBackend.TRITON, AttentionBackend.TORCH):
        try:
            row[f"layer_{backend.value}_s"] = _decode_layer_time(layer, config, states, backend)
        except Exception as error:  # noqa: BLE001
            row[f"layer_{backend.value}_s"] = f"error: {error!r}"[:300]
            traceback.print_exc()
    return row


def bench_prefill(kind_name: str, num_tokens: int, ceilings: dict, quick: bool) -> dict:
    import torch

    from moemesh.common.kernels.indexer_topk import indexer_scores, indexer_topk
    from moemesh.common.kernels.sparse_attention import sparse_attention
    from moemesh.common.kernels.sparse_attention_plan import SparseAttentionConfig
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import new_sequence_state

    kind = AttentionKind.CSA if kind_name == "csa" else AttentionKind.HCA
    config, layer = _layer_setup(kind)
    heads, head_dim, ratio, window = config.num_attention_heads, config.head_dim, config.compress_ratio(0), \
        config.sliding_window
    state = new_sequence_state(config, num_tokens + 64, torch.bfloat16, "cuda")
    num_rows = num_tokens // ratio
    state.layers[0].compressor.write_rows(0, torch.randn(num_rows, head_dim, device="cuda").to(torch.bfloat16))
    if kind is AttentionKind.CSA:
        state.layers[0].indexer.write_rows(0, torch.randn(num_rows, config.index_head_dim, device="cuda")
                                           .to(torch.bfloat16))
    batch = ForwardBatch([SequenceChunk(state, num_tokens)], "cuda", attention_backend=AttentionBackend.TRITON)
    tables = batch.attention_tables
    q = torch.randn(num_tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(num_tokens, head_dim, device="cuda", dtype=torch.bfloat16)
    topk_ids = None
    positions = torch.arange(num_tokens)
    visible = (positions + 1) // ratio
    if kind is AttentionKind.CSA:
        k = min(config.index_topk, num_rows)
        topk_ids = torch.randint(0, max(1, num_rows), (num_tokens, k), device="cuda", dtype=torch.int32)
        visible = visible.clamp(max=k)
    keys = positions.clamp(max=window - 1) + 1 + visible
    flops = 4 * heads * head_dim * int(keys.sum())
    row = {"kind": kind_name, "tokens": num_tokens, "core_flops": flops,
           "core_floor_s": floor_s(flops, ceilings["bf16_flops_per_s"]), "configs": {}}
    for block_h, block_n, warps, stages, splits in PREFILL_CONFIGS[:3] if quick else PREFILL_CONFIGS:
        cfg = SparseAttentionConfig(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages,
                                    num_splits=splits)
        name = f"h{block_h}_n{block_n}_w{warps}_s{stages}" + (f"_k{splits}" if splits else "")
        try:
            seconds = _event_time(lambda: sparse_attention(q, kv, layer.attn_sink, layer.scale, tables, 0,
                                                           window=window, ratio=ratio, topk_ids=topk_ids,
                                                           config=cfg))
            row["configs"][name] = seconds
        except Exception as error:  # noqa: BLE001
            row["configs"][name] = f"error: {error!r}"[:300]
    times = [v for v in row["configs"].values() if isinstance(v, float)]
    if times:
        row["core_best_s"] = min(times)
        row["core_fraction_of_bf16"] = row["core_floor_s"] / min(times)
    if kind is AttentionKind.CSA:
        queries = torch.randn(num_tokens, config.index_n_heads, config.index_head_dim, device="cuda",
                              dtype=torch.bfloat16)
        weights = torch.randn(num_tokens, config.index_n_heads, device="cuda")
        row["indexer_s"] = _event_time(lambda: indexer_topk(queries, weights, tables, 0, ratio=ratio,
                                                            topk=config.index_topk))
        row["indexer_scores_s"] = _event_time(lambda: indexer_scores(queries, weights, tables, 0, ratio=ratio))
        index_flops = 2 * config.index_n_heads * config.index_head_dim * int(((positions + 1) // ratio).sum())
        row["indexer_floor_s"] = floor_s(index_flops, ceilings["bf16_flops_per_s"])
    x = torch.randn(num_tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    backends = (AttentionBackend.TRITON,) if quick and num_tokens > 2048 else (AttentionBackend.TRITON,
                                                                                AttentionBackend.TORCH)
    for backend in backends:
        fresh_states = [new_sequence_state(config, num_tokens + 64, torch.bfloat16, "cuda") for _ in range(3)]
        batches = [ForwardBatch([SequenceChunk(s, num_tokens)], "cuda", attention_backend=backend)
                   for s in fresh_states]  # tables built outside the timed region

        def run() -> None:
            layer(x, batches.pop())
        try:
            row[f"layer_{backend.value}_s"] = _event_time(run, reps=2)
        except Exception as error:  # noqa: BLE001
            row[f"layer_{backend.value}_s"] = f"error: {error!r}"[:300]
            traceback.print_exc()
        torch.cuda.empty_cache()
    return row


def profile_layers(prefill_tokens: int, batch_size: int) -> None:
    """Top kernels by device time of one CSA layer (kernel path): a prefill and an eager decode step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moemesh.common.model.batch import ForwardBatch, SequenceChunk
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import fill_random_context, new_sequence_state

    config, layer = _layer_setup(AttentionKind.CSA)
    x = torch.randn(prefill_tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    batches = [ForwardBatch([SequenceChunk(new_sequence_state(config, prefill_tokens + 64, torch.bfloat16, "cuda"),
                                           prefill_tokens)], "cuda") for _ in range(2)]
    layer(x, batches[0])  # compile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x, batches[1])
        torch.cuda.synchronize()
    print(f"profile: CSA layer prefill {prefill_tokens} tokens (kernel path)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=70))
    generator = torch.Generator(device="cuda").manual_seed(0)
    states = []
    for _ in range(batch_size):
        state = new_sequence_state(config, CONTEXT_TOKENS + 64, torch.bfloat16, "cuda")
        fill_random_context(state, CONTEXT_TOKENS, generator=generator)
        states.append(state)
    x = torch.randn(batch_size, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    for step in range(2):
        batch = ForwardBatch([SequenceChunk(s, 1) for s in states], "cuda")
        torch.cuda.synchronize()
        if step:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                layer(x, batch)
                torch.cuda.synchronize()
        else:
            layer(x, batch)
        batch.finish()
    print(f"profile: CSA layer decode B = {batch_size} (kernel path, eager)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="two tile configs; no torch layer at 8K prefill")
    parser.add_argument("--batch", default="1,8,64")
    parser.add_argument("--prefill", default="2048,8192")
    parser.add_argument("--kinds", default="csa,hca")
    parser.add_argument("--profile", action="store_true", help="print top kernels of a CSA layer (prefill, decode)")
    args = parser.parse_args(argv)
    import torch

    from moemesh.bench.kernels import measure_ceilings
    from moemesh.bench.results_io import write_result

    if not torch.cuda.is_available():
        print("kernels_attention: needs CUDA", file=sys.stderr)
        return 2
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 {ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    raw = {"ceilings": ceilings, "decode": [], "prefill": []}
    torch.set_grad_enabled(False)
    kinds = args.kinds.split(",")
    for batch_size in (int(b) for b in args.batch.split(",") if b):
        for kind in kinds:
            try:
                row = bench_decode(kind, batch_size, ceilings, args.quick)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                row = {"kind": kind, "batch": batch_size, "error": repr(error)[:300]}
            raw["decode"].append(row)
            print("decode", _fmt(row), flush=True)
            print("json", json.dumps({"decode": row}), flush=True)  # survives a killed run
            torch.cuda.empty_cache()
    for num_tokens in (int(s) for s in args.prefill.split(",") if s):
        for kind in kinds:
            try:
                row = bench_prefill(kind, num_tokens, ceilings, args.quick)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                row = {"kind": kind, "tokens": num_tokens, "error": repr(error)[:300]}
            raw["prefill"].append(row)
            print("prefill", _fmt(row), flush=True)
            print("json", json.dumps({"prefill": row}), flush=True)
            torch.cuda.empty_cache()
    if args.profile:
        try:
            profile_layers(max(int(s) for s in args.prefill.split(",")), 64)
        except Exception:  # noqa: BLE001 - the figures above are written regardless
            traceback.print_exc()
    path = write_result("kernels-attention", raw, out_dir=args.out_dir)
    print(f"wrote {path}")
    return 0


def _fmt(row: dict) -> str:
    parts = []
    for key, value in row.items():
        if isinstance(value, float):
            parts.append(f"{key}={value * 1e6:.1f}us" if key.endswith("_s") else f"{key}={value:.3g}")
        elif isinstance(value, dict):
            parts.append(key + "{" + ", ".join(f"{k}={v * 1e6:.1f}us" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in value.items()) + "}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
