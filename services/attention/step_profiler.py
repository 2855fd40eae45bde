"""torch.profiler over a window of the attention worker's steps, for finding where a step's time goes.

`MOEMESH_TORCH_PROFILE_STEPS=SKIP:COUNT` (output directory `MOEMESH_TORCH_PROFILE_DIR`, default the working
one) profiles steps SKIP ..< SKIP + COUNT of the worker (counted from its first step, so warm-up captures and compiles can be
left out), each step inside a `moemesh.step.<kind>` range (kind as in step_phases.step_kind). When the window
closes it writes `<dir>/attention-<name>-<pid>.torch.json.gz` (the Chrome trace: CPU ops, CUDA kernels and
the step ranges on one time line) and `...torch.txt` (operators by self CUDA time and by self CPU time).
Off unless set; nothing per step but a counter when off.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
from pathlib import Path

import structlog
import torch

PROFILE_STEPS_ENV = "MOEMESH_TORCH_PROFILE_STEPS"
PROFILE_DIR_ENV = "MOEMESH_TORCH_PROFILE_DIR"

log = structlog.get_logger("attention")


def parse_window(value: str) -> tuple[int, int]:
    """"SKIP:COUNT" -> (skip, count); a clear error naming the variable otherwise."""
    try:
        skip, count = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"{PROFILE_STEPS_ENV}={value!r}: expected SKIP:COUNT, two integers") from None
    if skip < 0 or count < 1:
        raise ValueError(f"{PROFILE_STEPS_ENV}={value!r}: SKIP must be >= 0 and COUNT >= 1")
    return skip, count


class StepProfiler:
    """Counts steps; profiles those of its window (`step(kind)` is a context manager around one step)."""

    def __init__(self, skip: int, count: int, out_prefix: Path, device: torch.device) -> None:
        self.skip, self.count = skip, count
        self.out_prefix = out_prefix
        self.cuda = device.type == "cuda"
        self.num_steps = 0
        self.profiler: torch.profiler.profile | None = None

    @classmethod
    def from_env(cls, name: str, device: torch.device) -> "StepProfiler | None":
        window = os.environ.get(PROFILE_STEPS_ENV)
        if not window:
            return None
        skip, count = parse_window(window)
        directory = Path(os.environ.get(PROFILE_DIR_ENV) or ".")
        return cls(skip, count, directory / f"attention-{name}-{os.getpid()}", device)

    @contextlib.contextmanager
    def step(self, kind: str):
        index = self.num_steps
        self.num_steps += 1
        if not self.skip <= index < self.skip + self.count:
            yield
            return
        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        with torch.profiler.record_function(f"moemesh.step.{kind}"):
            yield
        if index == self.skip + self.count - 1:
            self.close()

    def close(self) -> None:
        """Stop and write the window's trace and tables (also at the worker's close, if still open)."""
        if self.profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        profiler, self.profiler = self.profiler, None
        self.out_prefix.parent.mkdir(parents=True, exist_ok=True)
        trace = self.out_prefix.with_name(self.out_prefix.name + ".torch.json")
        profiler.export_chrome_trace(str(trace))
        with open(trace, "rb") as source, gzip.open(f"{trace}.gz", "wb") as target:
            shutil.copyfileobj(source, target)
        trace.unlink()
        averages = profiler.key_averages()
        tables = []
        if self.cuda:
            tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=60))
        tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=60))
        self.out_prefix.with_name(self.out_prefix.name + ".torch.txt").write_text("\n\n".join(tables))
        log.info("attention.torch_profile_written", prefix=str(self.out_prefix), num_steps=self.count)
