"""The restarts `moemesh serve` made, as one small JSON file the router reads for /health and `/`.

`moemesh serve` (the parent of every service) is the only writer: after each restart, and when
it gives a service up, it rewrites `<run_dir>/serve_restarts.json` atomically (temporary file +
rename), so a reader never sees half a file. The router only reads it. A file, not a message,
because serve is not a wire peer of the router and the file outlives a router restart.

File shape: {"services": {name: {"num_restarts", "last_exit_code", "last_restart_unix_s",
"pid", "gave_up"}}}. Torch-free, standard library only.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

RESTARTS_FILE_NAME = "serve_restarts.json"


@dataclass(frozen=True)
class ChildRestarts:
    """One service's restart history under `moemesh serve`.
    last_exit_code: how the previous process ended (negative: killed by that signal);
    pid: the process now running (None while a restart waits out its backoff or after giving up);
    gave_up: the restart budget is spent and serve stopped restarting it."""

    num_restarts: int
    last_exit_code: int | None
    last_restart_unix_s: float | None
    pid: int | None
    gave_up: bool = False


def restarts_path_for(run_dir: str | Path) -> Path:
    return Path(run_dir) / RESTARTS_FILE_NAME


def write_restarts(path: str | Path, records: dict[str, ChildRestarts]) -> None:
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    body = {"services": {name: asdict(record) for name, record in sorted(records.items())}}
    temporary.write_text(json.dumps(body), encoding="utf-8")
    os.replace(temporary, path)


def read_restarts(path: str | Path | None) -> dict[str, dict]:
    """{name: record as a dict}; {} when there is no file (nothing restarted, or not under serve)."""
    if path is None:
        return {}
    try:
        body = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    services = body.get("services") if isinstance(body, dict) else None
    return {str(name): record for name, record in services.items() if isinstance(record, dict)} \
        if isinstance(services, dict) else {}
