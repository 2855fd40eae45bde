"""Model-loading progress of one service: log events and a small JSON file per service.

`LoadProgress(name, role, progress_dir)` is the `on_progress(num_bytes, num_tensors)` callback
`CheckpointReader` takes. It logs `<role>.load_progress` (at most every `min_interval_s`, so a
checkpoint of 70,000 tensors does not write 70,000 lines) and rewrites
`<progress_dir>/<name>.json` atomically (write + rename), which `moemesh serve`'s progress bar
and the router's status page read: {"name", "role", "num_bytes", "num_tensors", "done",
"updated_unix_s", "weights"}. `finish()` marks the load done (the runner calls it before Ready).
`report_weights(device, resident, stored)` records what the loaded weights occupy on the device beside
what the same tensors take in the checkpoint: one `<role>.weight_bytes` log event, and the file's
"weights" entry, which the router shows in /status.json and exports as `moemesh_worker_weight_bytes`.
No I/O at construction; a file that cannot be written is logged once and ignored (progress
must never fail a load).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import structlog

log = structlog.get_logger("service")


class LoadProgress:
    def __init__(self, name: str, role: str, progress_dir: str | Path | None, min_interval_s: float = 0.5) -> None:
        self.name = name
        self.role = role
        self.progress_dir = Path(progress_dir) if progress_dir is not None else None
        self.min_interval_s = min_interval_s
        self.num_bytes = 0
        self.num_tensors = 0
        self.done = False
        self.weights: dict | None = None  # {"device", "resident_bytes", "stored_bytes", "load_s"} once loaded
        self._started_s = time.monotonic()
        self._last_report_s = 0.0
        self._write_failed = False

    def __call__(self, num_bytes: int, num_tensors: int) -> None:
        """Cumulative counts of one reader (a second reader's counts add to the first's end)."""
        self.num_bytes, self.num_tensors = num_bytes, num_tensors
        now_s = time.monotonic()
        if now_s - self._last_report_s >= self.min_interval_s:
            self._last_report_s = now_s
            self._report()

    def finish(self) -> None:
        self.done = True
        self._report()

    def report_weights(self, device: str, resident_bytes: int, stored_bytes: int) -> None:
        """The held weights' bytes on `device` and the same tensors' bytes in the checkpoint."""
        load_s = time.monotonic() - self._started_s
        self.weights = {"device": str(device), "resident_bytes": int(resident_bytes),
                        "stored_bytes": int(stored_bytes), "load_s": round(load_s, 3)}
        log.info(f"{self.role}.weight_bytes", name=self.name, device=str(device), resident_bytes=int(resident_bytes),
                 stored_bytes=int(stored_bytes),
                 resident_over_stored=round(resident_bytes / stored_bytes, 4) if stored_bytes else None,
                 load_s=round(load_s, 3), load_s_per_gib_read=round(load_s / (self.num_bytes / 2**30), 3)
                 if self.num_bytes else None)
        self._write()

    def snapshot(self) -> dict:
        return {"name": self.name, "role": self.role, "num_bytes": self.num_bytes, "num_tensors": self.num_tensors,
                "done": self.done, "updated_unix_s": time.time(), "weights": self.weights}

    def _report(self) -> None:
        log.info(f"{self.role}.load_progress", name=self.name, num_bytes=self.num_bytes,
                 num_tensors=self.num_tensors, done=self.done)
        self._write()

    def _write(self) -> None:
        if self.progress_dir is None or self._write_failed:
            return
        try:
            self.progress_dir.mkdir(parents=True, exist_ok=True)
            path = self.progress_dir / f"{self.name}.json"
            temporary = path.with_suffix(f".json.{os.getpid()}.tmp")
            temporary.write_text(json.dumps(self.snapshot()), encoding="utf-8")
            os.replace(temporary, path)
        except OSError as error:
            self._write_failed = True
            log.warning("service.load_progress_unwritable", name=self.name, error=str(error)[:200])


def read_progress(progress_dir: str | Path) -> list[dict]:
    """Every service's latest progress record, sorted by name (unreadable files skipped)."""
    records = []
    directory = Path(progress_dir)
    if not directory.is_dir():
        return records
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # being replaced right now: the next read sees it
        if isinstance(record, dict) and isinstance(record.get("name"), str):
            records.append(record)
    return records


def progress_dir_for(run_dir: str | Path) -> Path:
    """Where the services of one deployment write their progress files."""
    return Path(run_dir) / "progress"


def weight_records(progress_dir: str | Path | None) -> list[dict]:
    """[{"name", "role", "device", "resident_bytes", "stored_bytes"}] of every service that reported its
    weights (see `LoadProgress.report_weights`), sorted by name."""
    if progress_dir is None:
        return []
    out = []
    for record in read_progress(progress_dir):
        weights = record.get("weights")
        if isinstance(weights, dict):
            out.append({"name": record["name"], "role": record.get("role"), **weights})
    return out
