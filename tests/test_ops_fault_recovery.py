"""Fault recovery with real processes: router, attention worker and two expert workers started
from one deployment file (the test plays supervisor; no replicas, so a lost worker's pairs can
only come back with it). In order:
- an expert worker SIGKILLed while a streamed completion is generating, and restarted: the
  attention worker rolls the step back and retries it on the restarted worker, so the stream
  completes with the reference tokens (or, should the budget run out, ends with finish_reason
  "error"); `/health` says 503 while the worker is gone and 200 afterwards, and later requests
  match the reference;
- an expert worker frozen (SIGSTOP) and thawed within the budget: detected by the dispatch
  timeout and the heartbeat silence, waited for, and the stream completes with the reference;
- an expert worker SIGKILLed and not restarted: after the recovery budget the stream ends with
  finish_reason "error" and a non-streaming request gets HTTP 503, nothing stays allocated, and
  after a restart the router and attention worker reconnect and serve again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from moemesh.commands.serve_config import ServeLayout, deployment_table
from moemesh.common.runtime.deployment_writer import write_deployment_file
from moemesh.common.runtime.launcher import start_service, stop_services, wait_until
from moemesh.services.attention.recovery import budget_for

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "models" / "kjv-dsv4-mini"
EOS_ID = 1
PROMPT = "And God said, Let there be light: and there was light."
DISPATCH_S, STEP_S = 1.5, 24.0
RECOVERY_BUDGET_S = budget_for(STEP_S, DISPATCH_S)  # what the attention worker derives (17 s)

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").exists(), reason="KJV tokenizer missing"),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer

    from moemesh.common.checkpoint.writer import write_checkpoint
    from tiny_checkpoint_support import random_hub_state_dict, tiny_config

    vocab_size = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = tiny_config(vocab_size=vocab_size, eos_token_id=EOS_ID)
    state = random_hub_state_dict(config, seed=4321)
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "kjv-tiny", config, state, tokenizer_dir=TOKENIZER_DIR)


def _reference_text(checkpoint: Path, prompt: str, max_tokens: int) -> str:
    from tokenizers import Tokenizer

    from moemesh.commands.generate import _load_model
    from moemesh.common.model.generate import GenerationConfig, generate_batch
    from moemesh.services.router.detokenizer import IncrementalDetokenizer, TokenBytes

    model, _ = _load_model(str(checkpoint), "float32", "cpu")
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True).ids  # as the server: BOS first
    token_ids = generate_batch(model, [prompt_ids], GenerationConfig(max_new_tokens=max_tokens,
                                                                     stop_token_ids=(EOS_ID,)))[0]
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, token_bytes=TokenBytes(tokenizer))
    return detokenizer.add(token_ids) + detokenizer.finish()


class Cluster:
    def __init__(self, checkpoint: Path, run_dir: Path) -> None:
        from moemesh.commands.serve import _write_placement

        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        port = _free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        layout = ServeLayout(model_path=str(checkpoint), run_dir=str(run_dir), log_dir=str(self.log_dir), port=port,
                             num_expert_workers=2,
                             placement_path=_write_placement(checkpoint, run_dir, 2, ("cpu",)))
        table = deployment_table(layout)
        table["timeouts"] = {"dispatch_s": DISPATCH_S, "step_s": STEP_S, "heartbeat_interval_s": 0.25}
        self.config_path = run_dir / "deployment.toml"
        write_deployment_file(self.config_path, table)
        self.services = {}
        for role, name in (("router", "router"), ("attention", "attention-0"), ("expert", "expert-0"),
                           ("expert", "expert-1")):
            self.services[name] = start_service(role, name, self.config_path, self.log_dir)

    def health(self) -> tuple[int, dict]:
        try:
            reply = httpx.get(f"{self.base_url}/health", timeout=5)
        except httpx.HTTPError:
            return 0, {}
        return reply.status_code, reply.json()

    def wait_healthy(self, timeout_s: float) -> bool:
        return wait_until(lambda: self.health()[0] == 200, timeout_s, poll_s=0.2)

    def restart(self, name: str) -> None:
        self.services[name] = start_service("expert", name, self.config_path, self.log_dir)

    def stop(self) -> None:
        order = ["router", "attention-0", "expert-0", "expert-1"]
        stop_services([self.services[name] for name in order], drain_s=10)

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-2500:]}"
                         for path in sorted(self.log_dir.glob("*.stderr")))


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    cluster = Cluster(checkpoint, tmp_path_factory.mktemp("run"))
    try:
        if not cluster.wait_healthy(180):
            pytest.fail(f"cluster not healthy: {cluster.health()}\n{cluster.logs()}")
        yield cluster
    finally:
        cluster.stop()


def _streamed_choices(cluster: Cluster, body: dict, errors: list[str] | None = None):
    """The choices of one streamed /v1/completions request (status 200 asserted), as they arrive;
    the messages of error events go to `errors`."""
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    if errors is not None:
                        errors.append(chunk["error"]["message"])
                    continue
                yield chunk["choices"][0]


def _complete(cluster: Cluster, prompt: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{cluster.base_url}/v1/completions", timeout=120, json={
        "model": "kjv-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_status_json_and_page_show_the_running_system(cluster):
    status = httpx.get(f"{cluster.base_url}/status.json", timeout=10).json()
    assert status["health"]["ok"] is True
    assert set(status["health"]["services"]) == {"attention-0", "expert-0", "expert-1"}
    assert status["engine"]["kv_blocks_total"]["gpu"] > 0
    names = {service["name"] for service in status["services"]}
    assert names == {"attention-0", "expert-0", "expert-1"}
    progress = {entry["name"]: entry for entry in status["load_progress"]}
    assert progress["expert-0"]["done"] and progress["expert-0"]["num_tensors"] > 0
    assert progress["attention-0"]["num_bytes"] > 0
    page = httpx.get(f"{cluster.base_url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "moemesh" in page.text and "/status.json" in page.text


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="no /usr/bin/chromium")
def test_status_page_renders_in_headless_chromium(cluster, tmp_path):
    import subprocess

    screenshot = tmp_path / "status.png"
    profile = f"--user-data-dir={tmp_path / 'profile'}"  # its own profile: another chromium may run beside it
    subprocess.run(["/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu", profile, "--virtual-time-budget=4000",
                    f"--screenshot={screenshot}", "--window-size=1200,900", f"{cluster.base_url}/"],
                   check=True, timeout=60, capture_output=True)
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = subprocess.run(["/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu", profile,
                          "--virtual-time-budget=4000", "--dump-dom", f"{cluster.base_url}/"],
                         check=True, timeout=60, capture_output=True, text=True).stdout
    assert "healthy" in dom and "expert-1" in dom  # the script fetched /status.json and rendered it


def test_expert_killed_mid_stream_is_recovered(cluster, checkpoint):
    max_tokens = 48
    expected = _reference_text(checkpoint, PROMPT, max_tokens)
    statuses: list[tuple[float, int]] = []
    stop_polling = threading.Event()

    def poll_health():
        while not stop_polling.is_set():
            statuses.append((time.monotonic(), cluster.health()[0]))
            time.sleep(0.2)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    pieces, finish_reason = [], None
    killed_at = None
    body = {"model": "kjv-tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    for choice in _streamed_choices(cluster, body):
        pieces.append(choice["text"])
        finish_reason = choice.get("finish_reason") or finish_reason
        if killed_at is None and len(pieces) == 3:
            os.kill(cluster.services["expert-1"].process.pid, signal.SIGKILL)
            cluster.services["expert-1"].process.wait(10)
            killed_at = time.monotonic()
            # restart once /health has shown the dead worker (the poller's 503), not before
            wait_until(lambda: any(code == 503 for at, code in list(statuses) if at > killed_at), 30, poll_s=0.1)
            cluster.restart("expert-1")
    assert killed_at is not None, "the stream ended before the kill"
    assert cluster.wait_healthy(60), cluster.logs()
    stop_polling.set()
    poller.join(5)
    print(f"recovery outcome: finish_reason={finish_reason}")
    assert finish_reason in ("length", "stop", "error")
    if finish_reason != "error":  # recovered: the very tokens of the reference
        assert "".join(pieces) == expected
    assert any(code == 503 for at, code in statuses if at > killed_at), "health never showed the dead worker"
    assert statuses[-1][1] == 200
    attention_log = (cluster.log_dir / "attention-0.log").read_text()
    assert "attention.step_lost_expert" in attention_log
    assert finish_reason == "error" or "attention.step_recovered" in attention_log

    later = _complete(cluster, PROMPT, 16)  # later requests succeed, with the reference output
    assert later.status_code == 200, later.text
    assert later.json()["choices"][0]["text"] == _reference_text(checkpoint, PROMPT, 16)


def test_expert_that_stops_answering_is_waited_for_and_the_stream_completes(cluster, checkpoint):
    """An expert worker frozen (SIGSTOP) mid-stream answers no dispatch and sends no heartbeat:
    the dispatch times out, /health turns 503, the attention worker rolls the step back and
    probes; once the worker runs again (SIGCONT) within the budget the step is retried on it
    and the stream completes with exactly the reference tokens."""
    max_tokens = 48
    expected = _reference_text(checkpoint, PROMPT, max_tokens)
    statuses: list[tuple[float, int]] = []
    pieces, finish_reason, frozen_at = [], None, None
    pid = cluster.services["expert-1"].process.pid
    recovered_before = _num_events(cluster, "attention.step_recovered")
    body = {"model": "kjv-tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        for choice in _streamed_choices(cluster, body):
            pieces.append(choice["text"])
            finish_reason = choice.get("finish_reason") or finish_reason
            if frozen_at is None and len(pieces) == 3:
                os.kill(pid, signal.SIGSTOP)
                frozen_at = time.monotonic()
                while time.monotonic() - frozen_at < 5.0:  # past the heartbeat silence bound
                    statuses.append((time.monotonic(), cluster.health()[0]))
                    time.sleep(0.2)
                os.kill(pid, signal.SIGCONT)
    finally:
        os.kill(pid, signal.SIGCONT)  # never leave it frozen for the tests after this one
    assert frozen_at is not None, "the stream ended before the freeze"
    print(f"frozen expert: finish_reason={finish_reason}, /health during the freeze {sorted({c for _, c in statuses})}")
    assert 503 in {code for _, code in statuses}, "health never showed the silent worker"
    assert finish_reason in ("length", "stop") and "".join(pieces) == expected
    assert cluster.wait_healthy(30), cluster.logs()
    assert _num_events(cluster, "attention.step_recovered") > recovered_before


def _num_events(cluster: Cluster, event: str) -> int:
    return sum(1 for line in (cluster.log_dir / "attention-0.log").read_text().splitlines()
               if line.startswith("{") and json.loads(line).get("event") == event)


def _idle_engine(cluster: Cluster) -> dict:
    """/status.json's engine figures once nothing runs (every request ended)."""
    engine: dict = {}

    def idle() -> bool:
        engine.update(httpx.get(f"{cluster.base_url}/status.json", timeout=10).json()["engine"])
        return engine["num_running"] == 0 and engine["num_waiting"] == 0

    assert wait_until(idle, 10, poll_s=0.2), engine
    return engine


def test_expert_that_stays_dead_fails_requests_after_the_budget_then_serving_resumes(cluster, checkpoint):
    """(Runs last: it leaves expert-1 dead until it restarts it.) Without a replica and without a
    restart, the attention worker retries within its budget and then gives up: the stream ends with
    finish_reason "error", the non-streaming request in the same steps gets HTTP 503 with a clear
    message, both within budget + dispatch timeout + a margin; nothing is left running or holding a
    KV block; /health is 503 until the worker is back, and serving then resumes."""
    assert _idle_engine(cluster)["kv_blocks_used"] == {"gpu": 0, "cpu": 0}
    outcome: dict = {}

    def non_streaming():
        outcome["reply"] = _complete(cluster, "In the beginning God created", 48)

    body = {"model": "kjv-tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True}
    pieces, finish_reason, killed_at, other = [], None, None, threading.Thread(target=non_streaming, daemon=True)
    errors: list[str] = []
    for choice in _streamed_choices(cluster, body, errors):
        if not pieces:
            other.start()  # joins the running batch
        pieces.append(choice["text"])
        finish_reason = choice.get("finish_reason") or finish_reason
        if killed_at is None and len(pieces) == 3:
            os.kill(cluster.services["expert-1"].process.pid, signal.SIGKILL)
            cluster.services["expert-1"].process.wait(10)
            killed_at = time.monotonic()
    ended_s = time.monotonic() - killed_at
    other.join(120)
    assert not other.is_alive(), "the non-streaming request hung"
    print(f"gave up after {ended_s:.1f} s (budget {RECOVERY_BUDGET_S:.0f} s); stream: {finish_reason}, "
          f"non-streaming: HTTP {outcome['reply'].status_code}")
    assert finish_reason == "error"
    assert len(errors) == 1 and "expert worker unavailable" in errors[0], errors  # the cause, in the stream
    assert ended_s < RECOVERY_BUDGET_S + DISPATCH_S + 10.0
    assert outcome["reply"].status_code == 503, outcome["reply"].text
    error = outcome["reply"].json()["error"]
    assert error["type"] == "service_unavailable_error" and "expert worker unavailable" in error["message"], error
    assert cluster.health()[0] == 503
    assert _idle_engine(cluster)["kv_blocks_used"] == {"gpu": 0, "cpu": 0}  # everything freed
    attention_log = (cluster.log_dir / "attention-0.log").read_text()
    assert "attention.step_abandoned" in attention_log

    cluster.restart("expert-1")  # the router and attention worker reconnect to it, no restart of their own
    assert cluster.wait_healthy(90), cluster.logs()
    later = _complete(cluster, PROMPT, 16)
    assert later.status_code == 200, later.text
    assert later.json()["choices"][0]["text"] == _reference_text(checkpoint, PROMPT, 16)
