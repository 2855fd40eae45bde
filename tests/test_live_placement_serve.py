"""`moemesh placement apply` against a running `moemesh serve`: scale in from two expert workers to one
and back out, under traffic from several clients; every request completes with unchanged output."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
PROMPTS = ["In the beginning God", "The LORD is my shepherd", "For God so loved", "Blessed are the"]
NUM_LAYERS, NUM_EXPERTS = 6, 8

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="default model not shipped")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _placement(experts_by_worker: dict[str, str]) -> str:
    lines = [f"format_version = 1\nnum_layers = {NUM_LAYERS}\nnum_experts = {NUM_EXPERTS}\n"
             "bytes_per_expert = 393216\npolicy = \"manual\"\n"]
    for name, ranges in experts_by_worker.items():
        lines.append(f"[[workers]]\nname = \"{name}\"\ndevice = \"cpu\"\n\n[workers.experts]")
        lines += [f"{layer} = \"{ranges}\"" for layer in range(NUM_LAYERS) if ranges]
        lines.append("")
    return "\n".join(lines)


def _complete(base: str, prompt: str) -> str:
    body = {"model": "kjv-dsv4-mini", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("live-placement")
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moemesh.cli", "serve", "--model", str(MODEL), "--expert-workers", "2", "--devices", "cpu",
         "--port", str(port), "--run-dir", str(run_dir / "run"), "--speculation", "off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("moemesh serve did not become healthy")
    yield base, run_dir
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def _apply(base: str, placement_toml: str, path: Path) -> dict:
    path.write_text(placement_toml)
    result = subprocess.run([sys.executable, "-m", "moemesh.cli", "placement", "apply", str(path), "--url", base],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_scale_in_and_out_under_traffic_keeps_outputs(server):
    base, run_dir = server
    expected = {prompt: _complete(base, prompt) for prompt in PROMPTS}
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
        scale_in = _apply(base, _placement({"expert-0": "0-7", "expert-1": ""}), run_dir / "in.toml")
        assert scale_in["dropped"]["expert-1"] > 0 and scale_in["loaded"]["expert-0"] > 0
        scale_out = _apply(base, _placement({"expert-0": "0-3", "expert-1": "4-7"}), run_dir / "out.toml")
        assert scale_out["placement_version"] > scale_in["placement_version"]
        assert scale_out["dropped"]["expert-0"] > 0 and scale_out["loaded"]["expert-1"] > 0
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
    assert not errors, errors
    assert len(outputs) >= len(PROMPTS)
    assert all(text == expected[prompt] for prompt, text in outputs)
    assert {prompt: _complete(base, prompt) for prompt in PROMPTS} == expected
