"""KV bytes per context token of a whole model as the attention worker stores them (`--kv-dtype`), measured.

`moemesh bench kv-bytes [--preset v4-flash | --model DIR] [--kv-dtype fp8|bf16] [--dtype bfloat16] [--device cpu]`
allocates one block and one resume snapshot of the attention worker's KV pool (`KVPool`, 128-token blocks) and one
`SequenceState` of the model with that storage, on the CPU by default (`--device meta`: shapes and dtypes only), and
reads the bytes from the tensors they allocate, per layer type:
- CSA, HCA: the compressed (main) rows; indexer: the CSA indexer's rows; a pool block holds nothing else, so its
  bytes over the block's tokens are what one more context token stores (the figure the goal of 3,850 B per token
  for V4-Flash with FP8 rows is about);
- what does not grow with the context: one resume snapshot (window rows of every layer, pending compressor
  inputs; the pool keeps a fixed number of them, `[kv] num_primary_snapshots`) and the window rings of one
  sequence.
The pool's tensors are grouped by `common.model.kv_sizing` (which the pool allocates from); the sequence state's
row tensors must give the same bytes per row (checked). Printed against `kv_rows.kv_bytes_per_token` (the formula
over the FP8 layouts: 3,850 B for V4-Flash) as a ratio.
`--json` prints the figures as one JSON object instead; `--save` also writes them under bench/results/
(kv-bytes-<device>-<time>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

from moemesh.common.model.config import ModelConfig
from moemesh.common.model.kv_rows import kv_bytes_per_token
from moemesh.common.model.kv_sizing import LayerType
from moemesh.common.model.kv_storage import KV_DTYPES, KVStorage
from moemesh.common.model.presets import PRESETS
from moemesh.common.model.state import SequenceState

POOL_BLOCK_TOKENS = 128


@dataclass(frozen=True)
class LayerTypeBytes:
    """One layer type's share of the pool, from the pool's tensors: bytes of one stored row, its layers, rows
    per context token over those layers, bytes per context token, and its part of one resume snapshot."""

    layer_type: str  # "window", "csa", "hca" or "indexer"
    num_layers: int
    row_bytes: int  # 0 for window layers (no growing rows)
    rows_per_token: float
    bytes_per_token: float  # rows: what grows with the context
    snapshot_bytes: int  # its part of one resume snapshot


@dataclass(frozen=True)
class KVBytesMeasurement:
    model: str
    kv_dtype: str
    dtype: str
    device: str
    layer_types: list[LayerTypeBytes]
    main_bytes_per_token: float  # CSA + HCA compressed rows
    indexer_bytes_per_token: float
    total_bytes_per_token: float  # every growing row of the pool
    pool_block_bytes_per_token: float  # everything a pool block allocates, over its tokens
    snapshot_bytes: int  # one resume snapshot of the pool
    window_bytes_per_sequence: int  # the window rings of one sequence state
    formula_bytes_per_token: float  # kv_rows.kv_bytes_per_token in this storage
    target_bytes_per_token: float  # the formula with FP8 rows (V4-Flash: 3,850)
    ratio_to_target: float  # a pool block per token / target


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check_state_rows(state: SequenceState, by_key: dict[tuple[int, str], int]) -> int:
    """The state's own row tensors store rows of the bytes the pool's do (ValueError otherwise); -> the window
    rings' bytes."""
    window_bytes = 0
    for layer, layer_state in enumerate(state.layers):
        window_bytes += _tensor_bytes(layer_state.window.ring)
        for which, store in (("compressor", layer_state.compressor), ("indexer", layer_state.indexer)):
            if store is None:
                continue
            state_row = store.own_rows.shape[1] * store.own_rows.element_size()
            if state_row != by_key[(layer, which)]:
                raise ValueError(f"layer {layer} {which}: the sequence state stores {state_row} B rows, the pool "
                                 f"{by_key[(layer, which)]} B")
    return window_bytes


def measure(config: ModelConfig, storage: KVStorage, dtype: torch.dtype, name: str,
            device: str = "cpu") -> KVBytesMeasurement:
    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.services.attention.kv_pool import KVPool

    pool = KVPool(config, KVPoolConfig(block_size_tokens=POOL_BLOCK_TOKENS, num_primary_blocks=1,
                                       num_primary_snapshots=1, kv_storage=storage), dtype, device)
    block = pool.config.block_size_tokens
    row_bytes_of: dict[tuple[int, str], int] = {}
    layer_types = []
    for layer_type in LayerType:
        segments = [segment for segment in pool.sizing.segments if segment.layer_type is layer_type]
        if not segments:
            continue
        rows = [segment for segment in segments if segment.grows]
        row_tensors = {segment.key: pool.primary[segment.key][0] for segment in rows}  # [R, Ws] of one block
        for key, tensor in row_tensors.items():
            row_bytes_of[key] = tensor.shape[1] * tensor.element_size()
        row_sizes = set(row_bytes_of[key] for key in row_tensors)
        if len(row_sizes) > 1:
            raise ValueError(f"{layer_type.value} rows of several sizes: {sorted(row_sizes)}")
        snapshot = sum(_tensor_bytes(pool.snapshot_primary[segment.key][0]) for segment in segments
                       if not segment.grows)
        layer_types.append(LayerTypeBytes(
            layer_type.value, len({segment.key[0] for segment in segments}), row_sizes.pop() if row_sizes else 0,
            sum(tensor.shape[0] for tensor in row_tensors.values()) / block,
            sum(_tensor_bytes(tensor) for tensor in row_tensors.values()) / block, snapshot))
    state = SequenceState(config, dtype=dtype, device=device, kv_storage=storage)
    window_bytes = _check_state_rows(state, row_bytes_of)
    by_type = {entry.layer_type: entry for entry in layer_types}
    main = sum(by_type[kind].bytes_per_token for kind in ("csa", "hca") if kind in by_type)
    indexer = by_type["indexer"].bytes_per_token if "indexer" in by_type else 0.0
    total = sum(entry.bytes_per_token for entry in layer_types)
    target = kv_bytes_per_token(config, KVStorage.FP8).per_token
    block_bytes = sum(_tensor_bytes(tensor[0]) for tensor in pool.primary.values())
    return KVBytesMeasurement(
        name, storage.value, str(dtype).removeprefix("torch."), device, layer_types, main, indexer, total,
        block_bytes / block, sum(entry.snapshot_bytes for entry in layer_types), window_bytes,
        kv_bytes_per_token(config, storage).per_token, target, block_bytes / block / target)


def report(m: KVBytesMeasurement) -> str:
    lines = [f"{m.model}: KV bytes per context token with --kv-dtype {m.kv_dtype} (activations {m.dtype}), "
             f"measured from a KV pool block on {m.device}",
             f"  {'layer type':<12}{'layers':>8}{'bytes/row':>11}{'rows/token':>12}{'bytes/token':>13}"
             f"{'snapshot bytes':>16}"]
    for entry in m.layer_types:
        lines.append(f"  {entry.layer_type:<12}{entry.num_layers:>8}{entry.row_bytes:>11}{entry.rows_per_token:>12.4f}"
                     f"{entry.bytes_per_token:>13.2f}{entry.snapshot_bytes:>16,}")
    lines += [
        f"  {'main rows (CSA + HCA)':<56}{m.main_bytes_per_token:>13.2f}",
        f"  {'indexer rows':<56}{m.indexer_bytes_per_token:>13.2f}",
        f"  {'total per context token':<56}{m.total_bytes_per_token:>13.2f}",
        f"  {'a pool block, all it allocates, per token':<56}{m.pool_block_bytes_per_token:>13.2f}",
        f"  target {m.target_bytes_per_token:,.2f} B (FP8 rows, kv_rows.kv_bytes_per_token): ratio "
        f"{m.ratio_to_target:.4f}; the formula in this storage: {m.formula_bytes_per_token:,.2f} B",
        f"  not growing with the context: one resume snapshot {m.snapshot_bytes:,} B (a fixed number per pool); "
        f"window rings {m.window_bytes_per_sequence:,} B per sequence",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default=None, help="built-in config (default v4-flash)")
    source.add_argument("--model", default=None, help="a checkpoint directory (its config.json)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=KVStorage.FP8.value)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activation dtype")
    parser.add_argument("--device", choices=("cpu", "meta"), default="cpu",
                        help="where the pool block and the sequence state are allocated (meta: shapes only)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--save", action="store_true", help="also write the figures under bench/results/")
    args = parser.parse_args(argv)
    if args.model is not None:
        config, name = ModelConfig.load(args.model), args.model
    else:
        preset = args.preset or "v4-flash"
        config, name = ModelConfig.from_dict(PRESETS[preset]()), preset
    measurement = measure(config, KVStorage(args.kv_dtype), getattr(torch, args.dtype), name, args.device)
    print(json.dumps(asdict(measurement)) if args.json else report(measurement))
    if args.save:
        from moemesh.bench.results_io import write_result

        ratios = {"bytes_per_token_over_target": measurement.ratio_to_target}
        print(write_result("kv-bytes", asdict(measurement), ratios,
                           device=f"{args.device} (one KV pool block and one sequence state)", tag=args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
