"""Start an attention worker and N expert workers as separate processes on this host, and stop them.

`LocalCluster` writes a deployment TOML and a placement TOML into a run directory (ipc://
sockets live there too), starts `python -m moemesh.cli expert|attention --config ... --name ...`
for each worker, waits until each answers a Ping (a service binds its endpoint only after it
loaded), and on exit stops every process it started: SIGTERM (the services drain and exit 0),
then SIGKILL after a bound. Children also get SIGKILL if this process dies (Linux
PR_SET_PDEATHSIG), so no worker outlives its launcher, even on error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from moemesh.services.attention.main import AttentionOptions

log = structlog.get_logger("attention")

_REPO_ROOT = Path(__file__).resolve().parents[2]


class ClusterError(RuntimeError):
    """A worker exited or did not become ready."""


@dataclass(frozen=True)
class ClusterSpec:
    model_path: str
    run_dir: str
    num_expert_workers: int = 1
    placement: str = "round_robin"  # round_robin | contiguous | all (every worker holds every expert)
    with_attention: bool = True  # False: expert workers only (tests drive an in-process attention worker)
    attention_device: str = "cpu"
    expert_devices: tuple[str, ...] = ("cpu",)  # cycled over the expert workers
    dtype: str = "auto"
    options: AttentionOptions = field(default_factory=AttentionOptions)
    ready_timeout_s: float = 120.0
    step_timeout_s: float = 120.0
    dispatch_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    log_level: str = "warning"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _toml_string(text: str) -> str:
    return json.dumps(text)


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.run_dir = Path(spec.run_dir)
        self.expert_names = [f"expert-{i}" for i in range(spec.num_expert_workers)]
        self.attention_name = "attention-0"
        self.processes: dict[str, subprocess.Popen] = {}
        self.attention_endpoint = f"ipc://{self.run_dir / (self.attention_name + '.sock')}"

    # ------------------------------------------------------------------ files
    def write_files(self) -> Path:
        from moemesh.common.model.config import ModelConfig
        from moemesh.common.placement.worker_holdings import contiguous, round_robin

        spec = self.spec
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = ModelConfig.load(spec.model_path)
        devices = [spec.expert_devices[i % len(spec.expert_devices)] for i in range(spec.num_expert_workers)]
        placement_path = self.run_dir / "placement.toml"
        if spec.placement == "all":
            placement_key = "all"
        else:
            from moemesh.common.placement.placement_file import write_placement

            build = {"round_robin": round_robin, "contiguous": contiguous}[spec.placement]
            from moemesh.common.placement.worker_budget import resident_bytes_per_expert

            bytes_per_expert = resident_bytes_per_expert(config)
            write_placement(placement_path, build(self.expert_names, devices, config.num_hidden_layers,
                                                  config.n_routed_experts, bytes_per_expert))
            placement_key = str(placement_path)
        lines = [
            "[model]", f"path = {_toml_string(str(Path(spec.model_path).resolve()))}",
            f"dtype = {_toml_string(spec.dtype)}", "",
            "[paths]", f"run_dir = {_toml_string(str(self.run_dir))}",
            f"log_dir = {_toml_string(str(self.run_dir / 'logs'))}", "",
            "[timeouts]", f"dispatch_s = {spec.dispatch_timeout_s}", f"step_s = {spec.step_timeout_s}",
            "heartbeat_interval_s = 5.0", "",
            "[[attention]]", f"name = {_toml_string(self.attention_name)}",
            f"device = {_toml_string(spec.attention_device)}",
        ]
        for name, device in zip(self.expert_names, devices):
            lines += ["", "[[expert]]", f"name = {_toml_string(name)}", f"device = {_toml_string(device)}",
                      f"placement = {_toml_string(placement_key)}"]
        path = self.run_dir / "deployment.toml"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    # ------------------------------------------------------------------ processes
    def _start(self, role: str, name: str, config_path: Path, extra: list[str]) -> None:
        command = [sys.executable, "-m", "moemesh.cli", role, "--config", str(config_path), "--name", name,
                   "--log-level", self.spec.log_level, *extra]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        stderr_path = self.run_dir / f"{name}.stderr"
        with open(stderr_path, "ab") as stderr:
            self.processes[name] = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                                                    env=env, start_new_session=True, preexec_fn=_die_with_parent)
        log.info("attention.cluster_process_started", name=name, role=role, pid=self.processes[name].pid)

    def start(self) -> None:
        config_path = self.write_files()
        options = self.spec.options
        try:
            for name in self.expert_names:
                self._start("expert", name, config_path, [])
            attention_args = ["--micro-batches", str(options.num_micro_batches),
                              "--kv-block-size", str(options.kv.block_size_tokens),
                              "--kv-primary-blocks", str(options.kv.num_primary_blocks),
                              "--kv-cpu-blocks", str(options.kv.num_cpu_blocks)]
            if options.placement_invariant:
                attention_args.append("--placement-invariant")
            if self.spec.with_attention:
                self._start("attention", self.attention_name, config_path, attention_args)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def endpoint_of(self, name: str) -> str:
        return f"ipc://{self.run_dir / (name + '.sock')}"

    def wait_ready(self) -> None:
        """Ping every worker until it answers (it binds only once loaded), within ready_timeout_s."""
        import zmq

        from moemesh.common.wire.errors import ReplyTimeout
        from moemesh.common.wire.messages import Ping, Pong
        from moemesh.common.wire.transport import SyncClient

        deadline = time.monotonic() + self.spec.ready_timeout_s
        context = zmq.Context()
        try:
            for name in self.processes:
                socket_path = Path(self.endpoint_of(name).removeprefix("ipc://"))
                while not socket_path.exists():  # bound only after the worker loaded
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise ClusterError(f"{name} not ready after {self.spec.ready_timeout_s:.0f}s")
                    time.sleep(0.05)
                client = SyncClient(self.endpoint_of(name), context=context)
                try:
                    reply = client.request(Ping(nonce=1), timeout_s=max(1.0, deadline - time.monotonic()))
                except ReplyTimeout:
                    raise ClusterError(f"{name} bound its socket but does not answer") from None
                finally:
                    client.close()
                if not isinstance(reply, Pong):
                    raise ClusterError(f"{name} answered a Ping with {type(reply).__name__}")
        finally:
            context.term()

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            code = process.poll()
            if code is not None:
                tail = self.stderr_tail(name)
                raise ClusterError(f"{name} exited with code {code}:\n{tail}")

    def stderr_tail(self, name: str, num_lines: int = 15) -> str:
        try:
            return "\n".join((self.run_dir / f"{name}.stderr").read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""

    def stop(self) -> dict[str, int]:
        """SIGTERM every started process (attention first), wait, SIGKILL stragglers; exit codes by name."""
        order = [self.attention_name, *self.expert_names]
        for name in order:
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = {}
        deadline = time.monotonic() + self.spec.stop_timeout_s
        for name in order:
            process = self.processes.get(name)
            if process is None:
                continue
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("attention.cluster_process_killed", name=name, pid=process.pid)
                process.kill()
                process.wait()
            codes[name] = process.returncode
        return codes

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.exit_codes = self.stop()
