"""Replicas and live placement end to end with real processes (router, attention worker, expert workers) on the default
model, under continuous traffic from four clients:

1. two expert workers that the deployment file does not list start (`--set expert[N]...
   placement=none`), announce themselves and appear in `/v1/admin/experts`, `moemesh placement
   show --url` and `/status.json`;
2. scale out from 1 to 3 expert workers, then rebalance to twins (expert-1 and expert-2 each hold
   half the experts and a replica of the other half; expert-0 drops everything);
3. SIGKILL of expert-2 while its twin lives: the steps that hit it are retried on expert-1,
   the router marks expert-2 gone;
4. scale in to expert-0 alone.
Every request completes and every greedy output equals the reference taken before any change.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from moemesh.commands.serve_config import ServeLayout, deployment_table
from moemesh.common.runtime.deployment_writer import write_deployment_file
from moemesh.common.runtime.launcher import start_service, stop_services, wait_until

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
PROMPTS = ["In the beginning God", "The LORD is my shepherd", "For God so loved", "Blessed are the"]
NUM_LAYERS, NUM_EXPERTS = 6, 8
MAX_TOKENS = 8

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="default model not shipped"),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _placement(primary: dict[str, str], replicas: dict[str, str] | None = None) -> str:
    lines = [f"format_version = 1\nnum_layers = {NUM_LAYERS}\nnum_experts = {NUM_EXPERTS}\n"
             "bytes_per_expert = 393216\npolicy = \"manual\"\n"]
    for name, ranges in primary.items():
        lines.append(f"[[workers]]\nname = \"{name}\"\ndevice = \"cpu\"\n\n[workers.experts]")
        lines += [f"{layer} = \"{ranges}\"" for layer in range(NUM_LAYERS) if ranges]
        extra = (replicas or {}).get(name)
        if extra:
            lines.append("\n[workers.replicas]")
            lines += [f"{layer} = \"{extra}\"" for layer in range(NUM_LAYERS)]
        lines.append("")
    return "\n".join(lines)


class Cluster:
    """The test plays `moemesh serve`: one deployment file, one process per service."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        port = _free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        table = deployment_table(ServeLayout(model_path=str(MODEL), run_dir=str(run_dir), log_dir=str(self.log_dir),
                                             port=port, num_expert_workers=1))
        table["timeouts"] = {"dispatch_s": 2.0, "step_s": 40.0, "heartbeat_interval_s": 0.25}
        self.config_path = run_dir / "deployment.toml"
        write_deployment_file(self.config_path, table)
        self.services = {name: start_service(role, name, self.config_path, self.log_dir)
                         for role, name in (("router", "router"), ("attention", "attention-0"),
                                            ("expert", "expert-0"))}

    def join(self, name: str) -> None:
        """Start an expert worker the deployment file does not list (its one expert entry: index 1
        appends); it holds nothing yet."""
        self.services[name] = start_service("expert", name, self.config_path, self.log_dir, extra_args=(
            "--set", f"expert[1].name={name}", "--set", "expert[1].placement=none"))

    def experts(self) -> dict[str, dict]:
        try:
            body = httpx.get(f"{self.base_url}/v1/admin/experts", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}
        return {worker["name"]: worker for worker in body["workers"]}

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        stop_services([self.services[name] for name in ("router", "attention-0", *sorted(
            n for n in self.services if n.startswith("expert")))], drain_s=10)

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}"
                         for path in sorted(self.log_dir.glob("*.stderr")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("replica-serve"))
    try:
        if not wait_until(cluster.healthy, 180):
            pytest.fail(f"cluster not healthy\n{cluster.logs()}")
        yield cluster
    finally:
        cluster.stop()


def _complete(base: str, prompt: str) -> str:
    body = {"model": "kjv-dsv4-mini", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("length", "stop"), choice
    return choice["text"]


def _apply(base: str, placement_toml: str, path: Path) -> dict:
    path.write_text(placement_toml)
    result = subprocess.run([sys.executable, "-m", "moemesh.cli", "placement", "apply", str(path), "--url", base],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_scale_out_rebalance_kill_a_twin_and_scale_in_under_traffic(cluster):
    base = cluster.base_url
    expected = {prompt: _complete(base, prompt) for prompt in PROMPTS}
    cluster.join("expert-1")
    cluster.join("expert-2")
    assert wait_until(lambda: {"expert-1", "expert-2"} <= {n for n, w in cluster.experts().items()
                                                            if w["state"] == "ready"}, 120), cluster.logs()
    joined = cluster.experts()["expert-1"]
    assert joined["num_experts"] == 0 and joined["device"] == "cpu" and joined["free_budget_bytes"] > 0
    shown = subprocess.run([sys.executable, "-m", "moemesh.cli", "placement", "show", "--url", base],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "expert-2" in shown.stdout and "ready" in shown.stdout, shown.stderr

    outputs: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def client(prompt: str) -> None:
        while not stop.is_set():
            try:
                outputs.append((prompt, _complete(base, prompt)))
            except BaseException as error:  # noqa: BLE001 (collected and asserted below)
                errors.append(error)
                return

    threads = [threading.Thread(target=client, args=(prompt,)) for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    try:
        out = _apply(base, _placement({"expert-0": "0-2", "expert-1": "3-5", "expert-2": "6-7"}),
                     cluster.run_dir / "out.toml")
        assert out["loaded"]["expert-1"] == 3 * NUM_LAYERS and out["dropped"]["expert-0"] == 5 * NUM_LAYERS
        status = httpx.get(f"{base}/status.json", timeout=10).json()
        assert status["placement"]["expert-2"]["0"] == [6, 7]  # the status page shows the joined worker
        twins = _apply(base, _placement({"expert-1": "0-3", "expert-2": "4-7", "expert-0": ""},
                                        {"expert-1": "4-7", "expert-2": "0-3"}), cluster.run_dir / "twins.toml")
        assert twins["dropped"]["expert-0"] == 3 * NUM_LAYERS
        num_before_kill = len(outputs)
        os.kill(cluster.services["expert-2"].process.pid, signal.SIGKILL)
        cluster.services["expert-2"].process.wait(10)
        assert wait_until(lambda: len(outputs) >= num_before_kill + len(PROMPTS) or errors, 120)
        assert wait_until(lambda: cluster.experts()["expert-2"]["state"] == "gone", 30)
        scale_in = _apply(base, _placement({"expert-0": "0-7"}), cluster.run_dir / "in.toml")
        assert scale_in["loaded"]["expert-0"] == NUM_LAYERS * NUM_EXPERTS
        num_after = len(outputs)
        assert wait_until(lambda: len(outputs) >= num_after + len(PROMPTS) or errors, 120)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
    assert not errors, f"{errors}\n{cluster.logs()}"
    assert len(outputs) >= 2 * len(PROMPTS)  # at least one round after the kill and one after the scale-in
    assert [(p, t) for p, t in outputs if t != expected[p]] == []
    attention_log = (cluster.log_dir / "attention-0.log").read_text()
    assert "attention.step_retry_on_replicas" in attention_log  # the twin took over, nothing waited
    assert {prompt: _complete(base, prompt) for prompt in PROMPTS} == expected
    assert cluster.healthy()
