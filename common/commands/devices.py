"""`moemesh devices`: the torch devices this host offers, with their memory."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def list_devices() -> list[dict]:
    """One entry per torch device: name, kind, total and free memory in bytes (None where unknown)."""
    import os

    import torch

    devices: list[dict] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            free_bytes, total_bytes = torch.cuda.mem_get_info(index)
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "device": f"cuda:{index}",
                    "name": props.name,
                    "total_bytes": total_bytes,
                    "free_bytes": free_bytes,
                    "multiprocessors": props.multi_processor_count,
                }
            )
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        for index in range(torch.xpu.device_count()):
            devices.append({"device": f"xpu:{index}", "name": torch.xpu.get_device_name(index),
                            "total_bytes": None, "free_bytes": None})
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append({"device": "mps", "name": "Apple MPS", "total_bytes": None, "free_bytes": None})
    total_bytes = free_bytes = None
    try:
        with open("/proc/meminfo") as meminfo:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
        total_bytes, free_bytes = fields.get("MemTotal"), fields.get("MemAvailable")
    except OSError:
        pass
    devices.append({"device": "cpu", "name": f"host CPU ({os.cpu_count()} cores)",
                    "total_bytes": total_bytes, "free_bytes": free_bytes})
    return devices


def _gib(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / 2**30:.1f} GiB"


def run(args: argparse.Namespace) -> int:
    devices = list_devices()
    if args.json:
        print(json.dumps(devices))
        return 0
    print(f"{'device':<8} {'total':>11} {'free':>11}  name")
    for entry in devices:
        print(f"{entry['device']:<8} {_gib(entry['total_bytes']):>11} {_gib(entry['free_bytes']):>11}  {entry['name']}")
    return 0
