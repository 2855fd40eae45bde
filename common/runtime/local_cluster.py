"""Expert workers (and an attention worker) as separate processes on this host, for runs without a
router: `moemesh generate --distributed`, the full-size benchmark, the tests.

`LocalCluster` writes a deployment TOML (common/runtime/deployment.py) into a run directory
(ipc:// sockets and each worker's stderr live there too), starts every worker
with the service launcher (common/runtime/launcher.py), waits until each answers a Ping (a
service binds its endpoint only after it loaded), and on exit stops every process it started:
SIGTERM (the services drain and exit 0), then SIGKILL after a bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moemesh.common.runtime.deployment_writer import write_deployment_file
from moemesh.common.runtime.launcher import ServiceProcess, start_service, stop_services


class ClusterError(RuntimeError):
    """A worker exited or did not become ready."""


@dataclass(frozen=True)
class ClusterSpec:
    model_path: str
    run_dir: str
    num_expert_workers: int = 1
    placement: str = "all"  # "all" (every worker holds every expert) or a placement file naming expert-0..N-1
    with_attention: bool = True  # False: expert workers only (the caller runs an attention worker in-process)
    attention_device: str = "cpu"
    expert_devices: tuple[str, ...] = ("cpu",)  # cycled over the expert workers
    dtype: str = "auto"
    attention_args: tuple[str, ...] = ()  # the attention worker's own options (`moemesh attention --help`)
    ready_timeout_s: float = 120.0
    step_timeout_s: float = 120.0
    dispatch_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    log_level: str = "warning"


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.run_dir = Path(spec.run_dir)
        self.expert_names = [f"expert-{i}" for i in range(spec.num_expert_workers)]
        self.attention_name = "attention-0"
        self.services: dict[str, ServiceProcess] = {}
        self.attention_endpoint = self.endpoint_of(self.attention_name)

    @property
    def processes(self) -> dict:
        """The running processes (subprocess.Popen) by name."""
        return {name: service.process for name, service in self.services.items()}

    @property
    def config_path(self) -> Path:
        return self.run_dir / "deployment.toml"

    # ------------------------------------------------------------------ files
    def deployment(self, placement_key: str, expert_devices: dict[str, str]) -> dict[str, Any]:
        """The deployment table: model, paths, timeouts, the attention worker, these expert workers."""
        spec = self.spec
        return {
            "model": {"path": str(Path(spec.model_path).resolve()), "dtype": spec.dtype},
            "paths": {"run_dir": str(self.run_dir), "log_dir": str(self.run_dir / "logs")},
            "timeouts": {"dispatch_s": spec.dispatch_timeout_s, "step_s": spec.step_timeout_s,
                         "heartbeat_interval_s": 5.0},
            "attention": [{"name": self.attention_name, "device": spec.attention_device}],
            "expert": [{"name": name, "device": device, "placement": placement_key}
                       for name, device in expert_devices.items()],
        }

    def write_files(self) -> Path:
        spec = self.spec
        self.run_dir.mkdir(parents=True, exist_ok=True)
        devices = [spec.expert_devices[i % len(spec.expert_devices)] for i in range(spec.num_expert_workers)]
        table = self.deployment(spec.placement, dict(zip(self.expert_names, devices)))
        return write_deployment_file(self.config_path, table)

    # ------------------------------------------------------------------ processes
    def start_worker(self, role: str, name: str, extra_args: tuple[str, ...] = (),
                     module: str = "moemesh.cli") -> None:
        self.services[name] = start_service(role, name, self.config_path, self.run_dir,
                                            ("--log-level", self.spec.log_level, *extra_args), module)

    def start(self) -> None:
        self.write_files()
        try:
            for name in self.expert_names:
                self.start_worker("expert", name)
            if self.spec.with_attention:
                self.start_worker("attention", self.attention_name, self.spec.attention_args)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def endpoint_of(self, name: str) -> str:
        return f"ipc://{self.run_dir / (name + '.sock')}"

    def wait_ready(self, names=None) -> None:
        """Ping every worker (or those named) until it answers (it binds only once loaded), within
        ready_timeout_s."""
        import zmq

        from moemesh.common.wire.errors import ReplyTimeout
        from moemesh.common.wire.messages import Ping, Pong
        from moemesh.common.wire.transport import SyncClient

        deadline = time.monotonic() + self.spec.ready_timeout_s
        context = zmq.Context()
        try:
            for name in self.services if names is None else names:
                socket_path = Path(self.endpoint_of(name).removeprefix("ipc://"))
                while not socket_path.exists():  # bound only after the worker loaded
                    self.check_alive([name])
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

    def check_alive(self, names=None) -> None:
        for name in self.services if names is None else names:
            code = self.services[name].exit_code
            if code is not None:
                raise ClusterError(f"{name} exited with code {code}:\n{self.services[name].stderr_tail(15)}")

    def stop(self) -> dict[str, int]:
        """SIGTERM every started process (the attention worker, the draft worker, then the expert
        workers), wait, SIGKILL stragglers; exit codes by name."""
        rank = {"attention": 0, "draft": 1}
        order = sorted(self.services.values(), key=lambda service: rank.get(service.role, 2))
        codes = stop_services(order, drain_s=0.0, margin_s=self.spec.stop_timeout_s)
        self.services.clear()
        return codes

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.exit_codes = self.stop()
