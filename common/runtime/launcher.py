"""Service child processes (`moemesh serve`, `generate --distributed`, the benchmarks): start,
watch, stop in order, never orphan.

Each service runs as `python -m moemesh.cli <role> --config FILE --name NAME` (or another module
taking the same options) in its own session (so a Ctrl-C on the terminal reaches only the
launcher, which then stops the services in order) with the parent-death signal set to SIGTERM on
Linux (so even a SIGKILLed launcher leaves no orphans). Its stderr goes to
`<log_dir>/<name>.stderr` (the structured log is in `<name>.log`, written by the service itself).
Imports no service.

Stop order matters: the router first (it stops taking HTTP requests and lets the open ones
finish while the workers are still up), then the attention worker, then the expert
workers. Each gets SIGTERM and `drain_s` + STOP_MARGIN_S seconds to exit (the router drains
for up to `drain_s`, then cuts what is open and stops its engine); then SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("serve")

_PR_SET_PDEATHSIG = 1
STOP_MARGIN_S = 15.0  # beyond the drain: cutting open streams, closing connections, stopping the engine


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the ordered stop in serve still applies


@dataclass
class ServiceProcess:
    name: str
    role: str  # router | attention | expert | draft
    process: subprocess.Popen
    stderr_path: Path
    # how it was started, so `restart_service` can run the same command again
    config_path: Path | None = None
    log_dir: Path | None = None
    extra_args: tuple[str, ...] = ()
    module: str = "moemesh.cli"

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def stderr_tail(self, num_lines: int = 20) -> str:
        try:
            lines = self.stderr_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])


def start_service(role: str, name: str, config_path: Path, log_dir: Path,
                  extra_args: tuple[str, ...] = (), module: str = "moemesh.cli") -> ServiceProcess:
    """extra_args: the service's own options (e.g. the draft worker's --speculation). module: what
    `python -m` runs; `moemesh.cli` gets the role as its subcommand, another module (a benchmark's
    instrumented worker) takes only the options."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = log_dir / f"{name}.stderr"
    command = [sys.executable, "-m", module, *([role] if module == "moemesh.cli" else []),
               "--config", str(config_path), "--name", name, *extra_args]
    env = dict(os.environ)
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    with open(stderr_path, "ab") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env,
                                   start_new_session=True, preexec_fn=_die_with_parent)
    log.info("serve.service_started", name=name, role=role, pid=process.pid)
    return ServiceProcess(name, role, process, stderr_path, Path(config_path), log_dir, tuple(extra_args), module)


def restart_service(service: ServiceProcess) -> ServiceProcess:
    """The same service started again with the same command (its stderr file is appended to)."""
    if service.config_path is None or service.log_dir is None:
        raise ValueError(f"{service.name} was not started by start_service: no command to repeat")
    return start_service(service.role, service.name, service.config_path, service.log_dir, service.extra_args,
                         service.module)


def stop_services(services: list[ServiceProcess], drain_s: float, margin_s: float = STOP_MARGIN_S) -> dict[str, int]:
    """Stop in the given order: SIGTERM, wait up to drain_s + margin_s, SIGKILL. Returns exit codes."""
    codes: dict[str, int] = {}
    for service in services:
        if service.exit_code is None:
            service.process.send_signal(signal.SIGTERM)
            try:
                service.process.wait(timeout=drain_s + margin_s)
            except subprocess.TimeoutExpired:
                log.warning("serve.service_killed", name=service.name, after_s=drain_s + margin_s)
                service.process.kill()
                service.process.wait()
        codes[service.name] = service.process.returncode
        log.info("serve.service_stopped", name=service.name, exit_code=service.process.returncode)
    return codes


def first_exited(services: list[ServiceProcess]) -> ServiceProcess | None:
    for service in services:
        if service.exit_code is not None:
            return service
    return None


def wait_until(predicate, timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def load_progress_bar(run_dir: Path, names: list[str], width: int = 20,
                      expected_bytes: dict[str, int] | None = None) -> str:
    """One line for the terminal: per service, a bar that fills as it loads (full when done) and
    the MiB read so far, from `<run_dir>/progress/*.json` (common.runtime.load_progress).
    `expected_bytes` (services.router.status_page_progress) sizes each service's share of the
    checkpoint; without an entry a service still loading shows an empty bar and its bytes."""
    from moemesh.common.runtime.load_progress import progress_dir_for, read_progress

    records = {record["name"]: record for record in read_progress(progress_dir_for(run_dir))}
    parts = []
    for name in names:
        record = records.get(name)
        if record is None:
            parts.append(f"{name} [{'.' * width}] starting")
            continue
        num_bytes = float(record.get("num_bytes", 0))
        expected = (expected_bytes or {}).get(name)
        if record.get("done"):
            filled = width
        else:
            filled = min(width, int(width * num_bytes / expected)) if expected else 0
        of_total = f" / {expected / 2**20:.1f}" if expected else ""
        parts.append(f"{name} [{'#' * filled}{'.' * (width - filled)}] {num_bytes / 2**20:.1f}{of_total} MiB"
                     f"{' ready' if record.get('done') else ''}")
    return "  ".join(parts)
