"""KV bytes per context token of a whole model as the attention worker stores them (`--kv-dtype`), measured.

`moemesh bench kv-bytes [--preset v4-flash | --model DIR] [--kv-dtype fp8|bf16] [--dtype bfloat16]` builds
one `SequenceState` of the model with that storage and one block of the attention worker's KV pool
(`KVPool`, 128-token blocks), both on the meta device (shapes and dtypes, no memory), and reads the bytes
from the tensors they allocate:
- per compressor store, the bytes of one stored row (its row tensor's row) times 1 / ratio rows per context
  token, summed over the layers: CSA and HCA compressed rows (the main rows) and CSA indexer rows; this is
  what grows with the context;
- the same growth from the pool: one block's row segments over its tokens (must agree);
- what does not grow: the window rings of one sequence, and each pool block's boundary snapshot (window
  rows and pending compressor inputs at the block's end, for prefix caching and swap-in).
Printed against `kv_rows.kv_bytes_per_token`, the formula: its main-row part, and its total, which assumes
FP8 indexer rows (3,850 B for V4-Flash). Indexer rows are stored in the activation dtype (bf16 on GPUs) in
moemesh, so the measured total with `--kv-dtype fp8` is the FP8 main rows plus bf16 indexer rows.
`--json` prints the figures as one JSON object instead; `--save` also writes them under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.kv_rows import kv_bytes_per_token
from moemesh.common.model.kv_storage import KV_DTYPES, KVStorage
from moemesh.common.model.presets import PRESETS
from moemesh.common.model.state import SequenceState

POOL_BLOCK_TOKENS = 128


@dataclass(frozen=True)
class StoreBytes:
    """One kind of growing rows: bytes of one stored row, rows per context token over all layers, their product."""

    kind: str  # "csa", "hca" (main rows) or "csa_indexer"
    row_bytes: int
    num_layers: int
    rows_per_token: float
    bytes_per_token: float


@dataclass(frozen=True)
class KVBytesMeasurement:
    model: str
    kv_dtype: str
    dtype: str
    stores: list[StoreBytes]
    main_bytes_per_token: float  # CSA + HCA compressed rows
    indexer_bytes_per_token: float
    total_bytes_per_token: float
    pool_row_bytes_per_token: float  # the same growth, from one KV pool block
    pool_snapshot_bytes_per_token: float  # each block's boundary snapshot, per token of the block
    window_bytes_per_sequence: int
    formula_main_bytes_per_token: float
    formula_total_bytes_per_token: float  # kv_rows.kv_bytes_per_token: FP8 indexer rows when kv_dtype is fp8


def _row_bytes(rows: torch.Tensor) -> int:
    """Bytes of one row of a [rows, Ws] tensor."""
    return rows.shape[1] * rows.element_size()


def measure(config: ModelConfig, storage: KVStorage, dtype: torch.dtype, name: str) -> KVBytesMeasurement:
    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.services.attention.kv_pool import KVPool

    state = SequenceState(config, dtype=dtype, device="meta", kv_storage=storage)
    found: dict[str, list[tuple[int, float]]] = {"csa": [], "hca": [], "csa_indexer": []}  # (row bytes, rows/token)
    window_bytes = 0
    for layer, layer_state in enumerate(state.layers):
        window_bytes += layer_state.window.ring.numel() * layer_state.window.ring.element_size()
        if layer_state.compressor is not None:
            kind = "csa" if layer_state.kind is AttentionKind.CSA else "hca"
            found[kind].append((_row_bytes(layer_state.compressor.own_rows), 1 / layer_state.compressor.ratio))
        if layer_state.indexer is not None:
            found["csa_indexer"].append((_row_bytes(layer_state.indexer.own_rows), 1 / layer_state.indexer.ratio))
    stores = []
    for kind, rows in found.items():
        if rows:
            stores.append(StoreBytes(kind, rows[0][0], len(rows), sum(r for _, r in rows),
                                     sum(b * r for b, r in rows)))
    by_kind = {store.kind: store.bytes_per_token for store in stores}
    main = by_kind.get("csa", 0.0) + by_kind.get("hca", 0.0)
    indexer = by_kind.get("csa_indexer", 0.0)
    pool = KVPool(config, KVPoolConfig(block_size_tokens=POOL_BLOCK_TOKENS, num_primary_blocks=1, kv_storage=storage),
                  dtype, "meta")
    pool_rows = pool.num_row_bytes_per_block() / POOL_BLOCK_TOKENS
    pool_snapshot = (pool.num_bytes_per_block() - pool.num_row_bytes_per_block()) / POOL_BLOCK_TOKENS
    formula = kv_bytes_per_token(config, storage)
    return KVBytesMeasurement(
        name, storage.value, str(dtype).removeprefix("torch."), stores, main, indexer, main + indexer, pool_rows,
        pool_snapshot, window_bytes, formula.per_token_by_kind["csa"] + formula.per_token_by_kind["hca"],
        formula.per_token)


def report(m: KVBytesMeasurement) -> str:
    lines = [f"{m.model}: KV bytes per context token with --kv-dtype {m.kv_dtype} (activations {m.dtype}), "
             f"measured from a sequence state and a KV pool block",
             f"  {'rows':<28}{'bytes/row':>10}{'layers':>8}{'rows/token':>12}{'bytes/token':>13}"]
    labels = {"csa": "CSA compressed (main)", "hca": "HCA compressed (main)", "csa_indexer": "CSA indexer"}
    for store in m.stores:
        lines.append(f"  {labels[store.kind]:<28}{store.row_bytes:>10}{store.num_layers:>8}"
                     f"{store.rows_per_token:>12.4f}{store.bytes_per_token:>13.2f}")
    lines += [
        f"  {'main rows (CSA + HCA)':<58}{m.main_bytes_per_token:>13.2f}",
        f"  {'total (main + indexer rows)':<58}{m.total_bytes_per_token:>13.2f}",
        f"  {'the same from one pool block':<58}{m.pool_row_bytes_per_token:>13.2f}",
        f"  not growing with the context: window rings {m.window_bytes_per_sequence:,} B per sequence; each pool "
        f"block's boundary snapshot {m.pool_snapshot_bytes_per_token:,.2f} B per token of the block",
        f"  formula (kv_rows.kv_bytes_per_token): main rows {m.formula_main_bytes_per_token:.2f} B, total "
        f"{m.formula_total_bytes_per_token:.2f} B"
        + (" (with FP8 indexer rows; moemesh keeps indexer rows in the activation dtype)"
           if m.kv_dtype == KVStorage.FP8.value else ""),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default=None, help="built-in config (default v4-flash)")
    source.add_argument("--model", default=None, help="a checkpoint directory (its config.json)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=KVStorage.FP8.value)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activation dtype")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--save", action="store_true", help="also write the figures under bench/results/")
    args = parser.parse_args(argv)
    if args.model is not None:
        config, name = ModelConfig.load(args.model), args.model
    else:
        preset = args.preset or "v4-flash"
        config, name = ModelConfig.from_dict(PRESETS[preset]()), preset
    measurement = measure(config, KVStorage(args.kv_dtype), getattr(torch, args.dtype), name)
    print(json.dumps(asdict(measurement)) if args.json else report(measurement))
    if args.save:
        from moemesh.bench.results_io import write_result

        print(write_result("kv-bytes", asdict(measurement), device="meta (no device: shapes only)", tag="meta"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
