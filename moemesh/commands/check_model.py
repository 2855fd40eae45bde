"""`moemesh check-model`: what a checkpoint holds, then one forward with the reference model."""

from __future__ import annotations

import argparse
import sys
import json


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("model_dir", nargs="?", default=None, metavar="DIR",
                        help="checkpoint directory (hub format or save_pretrained)")
    parser.add_argument("--model", default=None, help="the same directory, as an option")
    parser.add_argument("--prompt", default="Hello, world.", help="text for the test forward")
    parser.add_argument("--no-forward", action="store_true", help="only inspect headers (large models)")
    parser.add_argument("--device", default="cpu", help="torch device for the forward")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--tensors", action="store_true", help="list every tensor with its format and stored bytes")
    parser.add_argument("--deployment", default=None,
                        help="deployment TOML: print each worker's stored and resident weight bytes")
    parser.add_argument("--placement", default=None,
                        help="placement file: print each expert worker's stored and resident weight bytes")
    parser.add_argument("--expert-dtype", choices=("native", "fp8", "bf16"), default="native",
                        help="expert format assumed for --placement workers (a deployment names its own)")


def _format_bytes(num_bytes: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"


def _schedule_text(layers: list[dict]) -> str:
    """Runs of identical layers: '0-1 window/hash, 2 csa(4)/hash, ...'."""
    parts: list[str] = []
    start = 0
    for index in range(1, len(layers) + 1):
        if index < len(layers) and (layers[index]["attention"], layers[index]["router"]) == (
                layers[start]["attention"], layers[start]["router"]):
            continue
        first = layers[start]
        ratio = f"({first['compress_ratio']})" if first["compress_ratio"] else ""
        span = str(start) if index - 1 == start else f"{start}-{index - 1}"
        parts.append(f"{span} {first['attention']}{ratio}/{first['router']}")
        start = index
    return ", ".join(parts)


def _print_text(summary: dict) -> None:
    print(f"checkpoint {summary['path']} ({'hub names' if summary['hub_named'] else 'transformers names'})")
    kinds = {}
    for layer in summary["layers"]:
        kinds[layer["attention"]] = kinds.get(layer["attention"], 0) + 1
    routers = {}
    for layer in summary["layers"]:
        routers[layer["router"]] = routers.get(layer["router"], 0) + 1
    print(f"layers {summary['num_layers']}: " + ", ".join(f"{n} {k}" for k, n in kinds.items())
          + "; routers " + ", ".join(f"{n} {k}" for k, n in routers.items())
          + f"; mtp blocks {summary['num_mtp_blocks']}{' (DSpark)' if summary['dspark'] else ''}")
    print(f"schedule: {_schedule_text(summary['layers'])}")
    print(f"quantization: fp8 block {summary['fp8_block_size']}, experts {summary['expert_dtype']}")
    print(f"{'group':<15}{'params':>18}{'bytes':>14}  dtypes")
    for group in summary["groups"]:
        print(f"{group['group']:<15}{group['num_params']:>18,}{_format_bytes(group['num_bytes']):>14}  "
              f"{', '.join(group['dtypes'])}")
    print(f"{'total':<15}{summary['total_params']:>18,}{_format_bytes(summary['total_bytes']):>14}")
    print(f"{'format':<34}{'tensors':>9}{'stored':>14}")
    for row in summary["formats"]:
        print(f"{row['format']:<34}{row['num_tensors']:>9,}{_format_bytes(row['stored_bytes']):>14}")
    for row in summary.get("tensors", []):
        print(f"  {row['name']:<56}{str(row['shape']):<18}{row['format']:<30}{row['stored_bytes']:>14,}")
    if summary.get("workers"):
        print(f"{'worker':<16}{'role':<10}{'device':<9}{'pairs':>7}{'stored':>14}{'resident':>14}{'ratio':>7}")
        for row in summary["workers"]:
            ratio = row["resident_bytes"] / row["stored_bytes"] if row["stored_bytes"] else 0.0
            print(f"{row['name']:<16}{row['role']:<10}{row['device']:<9}{row['num_pairs']:>7}"
                  f"{_format_bytes(row['stored_bytes']):>14}{_format_bytes(row['resident_bytes']):>14}{ratio:>7.3f}")
    for label in ("missing", "unexpected", "mismatched"):
        count = summary[f"num_{label}"]
        print(f"{label}: {count}")
        for name in summary[label]:
            print(f"  {name}")
        if count > len(summary[label]):
            print(f"  ... {count - len(summary[label])} more")
    forward = summary.get("forward")
    if forward is not None:
        if "error" in forward:
            print(f"forward: FAILED: {forward['error']}")
        else:
            print(f"forward: {forward['num_tokens']} tokens ({forward['encoding']}), finite={forward['finite']}, "
                  f"max |logit| {forward['logits_abs_max']:.3f}; next-token top ids {forward['top_token_ids']} "
                  f"logits {forward['top_logits']}")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moemesh.common.checkpoint.errors import CheckpointError
    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.checkpoint.summary import encode_prompt, run_reference_forward, summarize
    from moemesh.common.model.config import ConfigError

    try:
        if (args.model_dir is None) == (args.model is None):
            print("check-model: name the checkpoint directory once, as DIR or --model DIR", file=sys.stderr)
            return 2
        args.model = args.model_dir or args.model
        reader = CheckpointReader(args.model, strict=False)
    except (CheckpointError, ConfigError, OSError) as error:
        print(json.dumps({"error": str(error)}) if args.json else f"error: {error}")
        return 1
    from moemesh.common.placement.worker_sizes import format_totals, tensor_rows, worker_rows
    from moemesh.common.runtime.deployment import DeploymentError

    summary = summarize(reader)
    rows = tensor_rows(reader)
    summary["formats"] = format_totals(rows)
    if args.tensors:
        summary["tensors"] = rows
    if args.deployment or args.placement:
        try:
            summary["workers"] = worker_rows(reader, deployment_path=args.deployment, placement_path=args.placement,
                                             dtype=args.dtype if args.deployment is None else "auto",
                                             expert_dtype=args.expert_dtype)
        except (DeploymentError, ValueError, OSError) as error:
            print(json.dumps({"error": str(error)}) if args.json else f"error: {error}")
            return 1
    problems = summary["num_mismatched"] + sum(1 for name in reader.report.missing if not name.startswith("mtp."))
    if not args.no_forward and not problems:
        token_ids, encoding = encode_prompt(Path(args.model), args.prompt, reader.config.vocab_size)
        try:
            forward = run_reference_forward(reader, token_ids, device=args.device, dtype=args.dtype)
            forward["encoding"] = encoding
        except Exception as error:  # report, do not hide: the summary is still useful
            forward = {"error": f"{type(error).__name__}: {error}"}
        summary["forward"] = forward
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_text(summary)
    failed_forward = "error" in summary.get("forward", {})
    return 1 if problems or failed_forward else 0
