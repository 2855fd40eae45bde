"""`moemesh bench layers-kernel-floors RESULT.json`: the per-kernel floors of a `bench layers` result.

A result file written before its decode entries carried `kernel_read_bytes_per_layer` (or by a run whose byte
counts are wanted again) still holds each decode kernel's profiled device time (`kernels_per_piece`); this
builds the same layers' attention side on the CPU (random weights in the checkpoint formats: only the tensor
sizes matter), counts the bytes each kernel must read (`layers_floors.kernel_read_bytes`, with the file's
expert bytes, context and batch sizes) and prints, per batch size and layer, each kernel's device µs against
its floor at the file's own measured copy bandwidth. Nothing is written back: the figures are the file's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def kernel_floor_rows(record: dict) -> list[dict]:
    """Per decode entry of `record`: {"batch_size", "layers": [{kernel: {device_us, launches, floor_us,
    x_floor}}]}."""
    import torch

    from moemesh.bench import layers_floors as floors
    from moemesh.bench.layers_report import kernel_floors
    from moemesh.common.model.config import NumericsConfig
    from moemesh.common.model.random_init import (
        LAYER_KIND_NAMES, flash_config, random_attention_side, tiny_flash_like_config,
    )

    raw = record["raw"]
    kinds = [LAYER_KIND_NAMES[name] for name in raw["config"]["layers"]]
    if raw["config"].get("checkpoint"):
        raise ValueError("a --checkpoint run: its entries carry kernel_read_bytes_per_layer already")
    config = tiny_flash_like_config(kinds) if raw["config"].get("tiny") else flash_config(kinds)
    dtype = getattr(torch, raw["config"].get("dtype", "bfloat16"))
    with torch.no_grad():
        side = random_attention_side(config, NumericsConfig(dtype=str(dtype).removeprefix("torch.")), "cpu")
    element_bytes = torch.finfo(dtype).bits // 8
    copy = raw["ceilings"]["copy_bytes_per_s"]
    out = []
    for entry in raw["decode"]:
        distinct = entry.get("distinct_experts_per_layer") or [None] * len(kinds)  # None: uniform routing
        read = entry.get("kernel_read_bytes_per_layer") or floors.kernel_read_bytes_per_layer(
            side, config, entry["batch_size"], entry["context_tokens"], element_bytes, raw["bytes"]["expert_bytes"],
            distinct)
        layers = kernel_floors({**entry, "kernel_read_bytes_per_layer": read}, len(kinds), copy)
        out.append({"batch_size": entry["batch_size"], "layers": layers})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a layers-*.json result file")
    args = parser.parse_args(argv)
    record = json.loads(args.result.read_text())
    kinds = record["raw"]["config"]["layers"]
    for entry in kernel_floor_rows(record):
        if entry["layers"] is None:
            print(f"b={entry['batch_size']}: no kernel profile in this run")
            continue
        for layer, rows in enumerate(entry["layers"]):
            print(f"b={entry['batch_size']} layer{layer} ({kinds[layer]}): "
                  "kernel | device us | launches | floor us | x")
            for name, row in sorted(rows.items(), key=lambda item: -(item[1]["device_us"] or 0)):
                device = "-" if row["device_us"] is None else f"{row['device_us']:.1f}"
                ratio = "-" if row["x_floor"] is None else f"{row['x_floor']:.1f}"
                print(f"  {name:34} {device:>8} {row['launches']:>4.0f} {row['floor_us']:9.2f} {ratio:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
