"""`moemesh check-model`: what a checkpoint holds, then one forward with the reference model."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (hub format or save_pretrained)")
    parser.add_argument("--prompt", default="Hello, world.", help="text for the test forward")
    parser.add_argument("--no-forward", action="store_true", help="only inspect headers (large models)")
    parser.add_argument("--device", default="cpu", help="torch device for the forward")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


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

    from common.checkpoint.errors import CheckpointError
    from common.checkpoint.reader import CheckpointReader
    from common.checkpoint.summary import encode_prompt, run_reference_forward, summarize
    from common.model.config import ConfigError

    try:
        reader = CheckpointReader(args.model, strict=False)
    except (CheckpointError, ConfigError, OSError) as error:
        print(json.dumps({"error": str(error)}) if args.json else f"error: {error}")
        return 1
    summary = summarize(reader)
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
