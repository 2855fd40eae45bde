"""`moemesh devices`: the torch devices this host offers, with their memory, and what
`moemesh serve --devices auto` (its default) picks: every CUDA GPU when there are some, else
the CPU."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _nvidia_driver_present() -> bool:
    """Whether this host may have an NVIDIA GPU at all (no torch import needed to say no)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or any(Path("/dev").glob("nvidia[0-9]*"))


def _torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def auto_devices(cuda_count: Callable[[], int] | None = None) -> tuple[str, ...]:
    """`--devices auto`: ("cuda:0", ..., "cuda:N-1") for the N CUDA GPUs torch sees, else ("cpu",).
    torch is imported only where an NVIDIA driver is present. `cuda_count`: how many GPUs (tests)."""
    if cuda_count is None:
        if not _nvidia_driver_present():
            return ("cpu",)
        cuda_count = _torch_cuda_count
    count = cuda_count()
    return tuple(f"cuda:{index}" for index in range(count)) or ("cpu",)


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
    chosen = auto_devices(lambda: sum(entry["device"].startswith("cuda:") for entry in devices))
    for entry in devices:
        entry["serve_auto"] = entry["device"] in chosen
    if args.json:
        print(json.dumps(devices))
        return 0
    print(f"{'device':<8} {'total':>11} {'free':>11}  name")
    for entry in devices:
        marker = "  (serve --devices auto)" if entry["serve_auto"] else ""
        print(f"{entry['device']:<8} {_gib(entry['total_bytes']):>11} {_gib(entry['free_bytes']):>11}  "
              f"{entry['name']}{marker}")
    print(f"moemesh serve --devices auto uses: {','.join(chosen)}")
    return 0
