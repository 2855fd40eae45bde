"""Helpers for `test_ops_netns.py` (not a test module): two "hosts" made of Linux network
namespaces joined by a veth pair, services started inside them, HTTP through curl run in a
namespace, and a small CURVE probe that runs as a script inside a namespace.

Everything here is root-only and touches only namespaces and links it created itself (names
carry the test process id), so traffic never leaves them. `TwoHosts.close` deletes both
namespaces, which also removes the veth pair.

Run as a script (`python tests/ops_netns_support.py probe ENDPOINT SERVER_PUBLIC_KEY_FILE
[KEYS_DIR NAME]`) it sends one Ping over CURVE and prints `pong` or `timeout`: with a key
pair from KEYS_DIR (a legitimate client) or, without one, a freshly generated stranger key.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def netns_available() -> str | None:
    """None when namespaces can be made here; otherwise the reason to skip."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) missing"
    probe = f"mmprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(("-n", netns) if netns else ()), *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


@dataclass
class TwoHosts:
    """Namespace `ns_a` (address `addr_a`) and `ns_b` (`addr_b`) on one /24 through a veth pair
    whose ends are `veth_a` (in ns_a) and `veth_b` (in ns_b)."""

    ns_a: str
    ns_b: str
    addr_a: str = "10.231.0.1"
    addr_b: str = "10.231.0.2"
    veth_a: str = "mmveth-a"
    veth_b: str = "mmveth-b"
    created: list[str] = field(default_factory=list)

    @classmethod
    def create(cls) -> TwoHosts:
        tag = os.getpid() % 100000
        hosts = cls(ns_a=f"mm{tag}a", ns_b=f"mm{tag}b")
        try:
            for ns in (hosts.ns_a, hosts.ns_b):
                _ip("netns", "add", ns)
                hosts.created.append(ns)
                _ip("link", "set", "lo", "up", netns=ns)
            # Create the pair directly inside ns_a, then move one end: the root namespace never holds it.
            _ip("link", "add", hosts.veth_a, "type", "veth", "peer", "name", hosts.veth_b, netns=hosts.ns_a)
            _ip("link", "set", hosts.veth_b, "netns", hosts.ns_b, netns=hosts.ns_a)
            _ip("addr", "add", f"{hosts.addr_a}/24", "dev", hosts.veth_a, netns=hosts.ns_a)
            _ip("addr", "add", f"{hosts.addr_b}/24", "dev", hosts.veth_b, netns=hosts.ns_b)
            hosts.set_link(up=True)
        except BaseException:
            hosts.close()
            raise
        return hosts

    def set_link(self, *, up: bool) -> None:
        """Cut (up=False) or restore the link; both ends, so neither side sees a carrier."""
        state = "up" if up else "down"
        _ip("link", "set", self.veth_a, state, netns=self.ns_a)
        _ip("link", "set", self.veth_b, state, netns=self.ns_b)

    def close(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()


@dataclass
class NsService:
    name: str
    role: str
    netns: str
    process: subprocess.Popen
    stderr_path: Path


def start_in_netns(netns: str, role: str, name: str, config_path: Path, log_dir: Path) -> NsService:
    """`moemesh <role> --config FILE --name NAME` inside a namespace (`ip netns exec` execs the
    command, so the Popen pid is the service itself and signals reach it directly)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = log_dir / f"{name}.stderr"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = ["ip", "netns", "exec", netns, sys.executable, "-m", "moemesh.cli", role,
               "--config", str(config_path), "--name", name]
    with open(stderr_path, "ab") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env,
                                   cwd=str(REPO_ROOT), start_new_session=True)
    return NsService(name, role, netns, process, stderr_path)


def stop_all(services: list[NsService], drain_s: float = 10.0) -> None:
    for service in services:
        if service.process.poll() is None:
            service.process.send_signal(signal.SIGTERM)
            try:
                service.process.wait(timeout=drain_s)
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()


@dataclass(frozen=True)
class HttpReply:
    status: int | None  # None: no HTTP answer at all (connection failed or the time bound ran out)
    body: str


def http_in_netns(netns: str, url: str, body: dict | None = None, *, max_time_s: float = 60.0) -> HttpReply:
    """GET (body None) or POST JSON through curl inside `netns`, bounded by `max_time_s`."""
    command = ["ip", "netns", "exec", netns, "curl", "-sS", "-N", "--max-time", str(max_time_s),
               "-o", "-", "-w", "\n%{http_code}"]
    if body is not None:
        command += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    done = subprocess.run([*command, url], capture_output=True, text=True, timeout=max_time_s + 15)
    text, _, code = done.stdout.rpartition("\n")
    status = int(code) if code.strip().isdigit() and int(code) > 0 else None
    return HttpReply(status, text)


def parse_stream(text: str) -> tuple[str, str | None]:
    """Concatenated text and the last finish_reason of an SSE completion stream."""
    pieces, finish_reason = [], None
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:  # the cause of a finish_reason "error", as its own event
            continue
        choice = chunk["choices"][0]
        pieces.append(choice.get("text", ""))
        finish_reason = choice.get("finish_reason") or finish_reason
    return "".join(pieces), finish_reason


def run_probe(netns: str, endpoint: str, server_key_file: Path, keys_dir: Path | None = None,
              name: str | None = None, timeout_s: float = 3.0) -> str:
    """Run this file's `probe` inside `netns`; returns "pong" or "timeout"."""
    command = ["ip", "netns", "exec", netns, sys.executable, str(Path(__file__).resolve()), "probe", endpoint,
               str(server_key_file), str(timeout_s)]
    if keys_dir is not None and name is not None:
        command += [str(keys_dir), name]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s + 30, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"probe failed: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def _probe(argv: list[str]) -> int:
    import tempfile

    import zmq

    from moemesh.common.security.curve import generate_key_pair, load_key_pair, load_public_key
    from moemesh.common.security.socket_security import SocketSecurity
    from moemesh.common.wire import messages as m
    from moemesh.common.wire.errors import ReplyTimeout
    from moemesh.common.wire.transport import SyncClient

    endpoint, server_key_file, timeout_s = argv[0], Path(argv[1]), float(argv[2])
    own = load_key_pair(argv[3], argv[4]) if len(argv) >= 5 else generate_key_pair("stranger")
    with tempfile.TemporaryDirectory() as unused_dir:
        security = SocketSecurity(own_keys=own, server_keys_by_endpoint={endpoint: load_public_key(server_key_file)},
                                  allowed_clients_dir=Path(unused_dir))
        context = zmq.Context()
        client = SyncClient(endpoint, context=context, security=security, default_timeout_s=timeout_s)
        try:
            reply = client.request(m.Ping(nonce=7))
            print("pong" if isinstance(reply, m.Pong) else f"unexpected {type(reply).__name__}")
        except ReplyTimeout:
            print("timeout")
        finally:
            client.close()
            context.term()
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "probe":
        sys.exit(_probe(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} probe ENDPOINT SERVER_KEY_FILE TIMEOUT_S [KEYS_DIR NAME]")
