"""`moemesh serve` as a subprocess for the speculation tests and the benchmark's checks."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "kjv-dsv4-mini"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServeProcess:
    base_url: str
    process: subprocess.Popen
    run_dir: Path
    first_line: str

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def logs(self) -> str:
        parts = [(self.run_dir / "serve.stderr").read_text(errors="replace")[-3000:]]
        for path in sorted((self.run_dir / "logs").glob("*.stderr")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)


def start_serve(run_dir: Path, *args: str, model: Path | str = DEFAULT_MODEL, timeout_s: float = 240.0,
                env: dict[str, str] | None = None, devices: str | None = "cpu") -> ServeProcess:
    """Start `moemesh serve` and wait for its first stdout line (the URL, or nothing if it failed).
    `env`: variables added to this process's environment for serve and its services. `devices`:
    cpu unless a test asks for others (the references the tests compare with are float32 CPU
    ones); None: serve's default, auto; a `--devices` in `args` comes later and wins."""
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "moemesh.cli", "serve", "--model", str(model), "--port", str(port),
               "--run-dir", str(run_dir), "--ready-timeout", str(int(timeout_s)), "--drain-timeout", "20",
               *(("--devices", devices) if devices else ()), *args]
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(REPO_ROOT))
    with open(run_dir / "serve.stderr", "wb") as stderr:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    first, deadline = "", time.monotonic() + timeout_s + 30
    while not first and process.poll() is None and time.monotonic() < deadline:
        try:
            first = lines.get(timeout=0.5)
        except queue.Empty:
            pass
    return ServeProcess(f"http://127.0.0.1:{port}", process, run_dir, first)
