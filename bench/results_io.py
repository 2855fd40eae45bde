"""Benchmark result files: one JSON per run under bench/results/, named `<benchmark>-<device>-<UTC time>.json`.

Every benchmark writes date, device, commit, the command that produced it, the raw numbers and
the ratios it derives, so figures can be compared within one run and traced back later. The device
part of the name is short (`h200`, `h200x2` for a host with two, `cpu`); the record's `device` field
says the rest (model name, torch version, threads).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def current_commit(directory: Path | None = None) -> str | None:
    """The checkout's short commit (of `directory`, default this one), with "+changes" when its tracked files
    differ from it (a device copy of a working tree, a run before a commit): the figures then come from that
    commit and changes on top."""
    here = directory or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip()
    if not commit:
        return None
    return f"{commit}+changes" if changed.returncode == 0 and changed.stdout.strip() else commit


def describe_device() -> str:
    """A human-readable device name: the CUDA device if one is used, else the CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
        cpu_count = torch.get_num_threads()
    except ImportError:  # the router-side benchmarks run without torch
        cpu_count = None
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu} ({cpu_count} threads)" if cpu_count else f"CPU {cpu}"


def device_tag() -> str:
    """Short name of this host's accelerator for result file names: `h200`, `h200x2` (two of them), `cpu`."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    words = [w for w in re.split(r"[^a-z0-9]+", torch.cuda.get_device_name(0).lower()) if w and w != "nvidia"]
    tag = "".join(words) or "cuda"
    count = torch.cuda.device_count()
    return f"{tag}x{count}" if count > 1 else tag


def write_result(
    name: str,
    raw: dict,
    ratios: dict | None = None,
    *,
    device: str | None = None,
    command: str | None = None,
    out_dir: Path | None = None,
    tag: str | None = None,
) -> Path:
    """Write `bench/results/<name>-<tag>-<utc timestamp>.json` (and its plot beside it, bench.plots) and
    return the JSON's path. `tag` names the device the figures are of (default: `device_tag()`)."""
    now = _dt.datetime.now(_dt.timezone.utc)
    record = {
        "benchmark": name,
        "date": now.isoformat(timespec="seconds"),
        "device": device or describe_device(),
        "commit": current_commit(),
        "command": command or " ".join(sys.argv),
        "environment": {key: value for key, value in sorted(os.environ.items()) if key.startswith("MOEMESH_")},
        "raw": raw,
        "ratios": ratios or {},
    }
    target_dir = out_dir or RESULTS_DIR
    target_dir.mkdir(parents=True, exist_ok=True)
    path = target_dir / f"{name}-{tag or device_tag()}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    from moemesh.bench.plots import render_beside

    render_beside(path)  # the PNG of the same name beside the JSON; nothing (and a note) without matplotlib
    return path
