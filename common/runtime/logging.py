"""Structured JSON logging for every moemesh service (structlog).

One JSON object per line, to stderr and to `<log_dir>/<service>.log`. Every event carries
`service`, `pid`, `level` and a UTC timestamp; `request_id` and `step_id` are added from
context variables while `bound_request(...)` is active, so helpers deep in a step need no
logger argument. Event names are `<service area>.<what happened>` (`wire.dropped`,
`service.ready`). Nothing per token at info level.

`configure_logging` is called once from a service's main(); importing this module does no I/O.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _TeeWriter:
    """A file-like object writing each line to stderr and to the log file.

    stderr is looked up at every write, not captured once: whoever replaced `sys.stderr` since
    configuration (a test harness, a daemonising wrapper) gets the events, and a stream closed
    since then is never written to.
    """

    def __init__(self, files: list[IO[str]]) -> None:
        self.files = files

    def _streams(self) -> list[IO[str]]:
        return [sys.stderr, *self.files]

    def write(self, text: str) -> int:
        for stream in self._streams():
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self._streams():
            stream.flush()


def configure_logging(service: str, log_dir: str | Path | None, level: str = "info") -> Path | None:
    """Route structlog events of this process to stderr and `<log_dir>/<service>.log`.

    Returns the log file path (None when log_dir is None: stderr only). Raises ValueError
    for an unknown level. Safe to call again (tests); the last call wins.
    """
    if level.lower() not in _LEVELS:
        raise ValueError(f"log level {level!r} is not one of {sorted(_LEVELS)}")
    files: list[IO[str]] = []
    log_path = None
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_path = Path(log_dir) / f"{service}.log"
        files.append(open(log_path, "a", buffering=1, encoding="utf-8"))  # noqa: SIM115 (lives as long as the process)
    pid = os.getpid()

    def add_service(_logger: Any, _method: str, event: dict) -> dict:
        event.setdefault("service", service)
        event.setdefault("pid", pid)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        logger_factory=structlog.WriteLoggerFactory(file=_TeeWriter(files)),
        cache_logger_on_first_use=False,
    )
    return log_path


@contextlib.contextmanager
def bound_request(request_id: str | None = None, step_id: int | None = None) -> Iterator[None]:
    """Add request_id / step_id to every event logged inside the block (this task only)."""
    values = {key: value for key, value in (("request_id", request_id), ("step_id", step_id)) if value is not None}
    with structlog.contextvars.bound_contextvars(**values):
        yield
