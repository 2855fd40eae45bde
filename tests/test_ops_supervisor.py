"""supervisord (from PyPI; skipped without it) runs moemesh from `deploy/supervisor/moemesh.conf`
with only its paths rewritten to a tmp dir (binary, config, logs, user) over a tiny random
checkpoint: router, one attention worker and two expert workers. An expert worker is SIGKILLed
while a streamed completion is generating; supervisord restarts it (a new pid), the in-flight
stream ends either with the reference tokens or with finish_reason "error" (never hangs: the
client has a bounded timeout), and a later request returns the reference output.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("supervisor")

from moemesh.commands.serve_config import ServeLayout, deployment_table  # noqa: E402
from moemesh.common.runtime.deployment_writer import write_deployment_file
from moemesh.common.runtime.launcher import wait_until  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
PROGRAM_CONF = REPO_ROOT / "deploy" / "supervisor" / "moemesh.conf"
TOKENIZER_DIR = REPO_ROOT / "models" / "kjv-dsv4-mini"
MOEMESH_BIN = Path(sys.executable).parent / "moemesh"
SUPERVISORD_BIN = Path(sys.executable).parent / "supervisord"
SUPERVISORCTL_BIN = Path(sys.executable).parent / "supervisorctl"
EOS_ID = 1
PROMPT = "And God said, Let there be light: and there was light."
KILLED = "moemesh:moemesh-expert-1"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").exists(), reason="KJV tokenizer missing"),
    pytest.mark.skipif(not (MOEMESH_BIN.exists() and SUPERVISORD_BIN.exists()),
                       reason="the moemesh / supervisord console scripts are not installed beside this python"),
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
    state = random_hub_state_dict(config, seed=2468)
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "kjv-tiny", config, state, tokenizer_dir=TOKENIZER_DIR)


def _reference_text(checkpoint: Path, prompt: str, max_tokens: int) -> str:
    from tokenizers import Tokenizer

    from moemesh.commands.generate import _load_model
    from moemesh.common.model.generate import GenerationConfig, generate_batch
    from moemesh.services.router.detokenizer import IncrementalDetokenizer, TokenBytes

    model, _ = _load_model(str(checkpoint), "float32", "cpu")
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True).ids  # as the server: BOS first
    config = GenerationConfig(max_new_tokens=max_tokens, stop_token_ids=(EOS_ID,))
    token_ids = generate_batch(model, [prompt_ids], config)[0]
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, token_bytes=TokenBytes(tokenizer))
    return detokenizer.add(token_ids) + detokenizer.finish()


def program_conf_for(tmp_dir: Path, config_path: Path, log_dir: Path) -> str:
    """deploy/supervisor/moemesh.conf with the install paths of deploy/README.md pointed here."""
    text = PROGRAM_CONF.read_text()
    for installed, here in (("/opt/moemesh/.venv/bin/moemesh", str(MOEMESH_BIN)),
                            ("/etc/moemesh/moemesh.toml", str(config_path)),
                            ("/var/log/moemesh/", f"{log_dir}/"),
                            ("directory=/opt/moemesh", f"directory={REPO_ROOT}"),
                            ("user=moemesh", f"user={getpass.getuser()}")):
        assert installed in text, installed  # the file still has the shape this test rewrites
        text = text.replace(installed, here)
    return text


class Supervised:
    def __init__(self, checkpoint: Path, tmp_dir: Path) -> None:
        from moemesh.commands.serve import _write_placement

        self.tmp_dir = tmp_dir
        self.log_dir = tmp_dir / "logs"
        self.log_dir.mkdir()
        port = _free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        layout = ServeLayout(model_path=str(checkpoint), run_dir=str(tmp_dir / "run"), log_dir=str(self.log_dir),
                             port=port, num_expert_workers=2,
                             placement_path=_write_placement(checkpoint, tmp_dir, 2, ("cpu",)))
        table = deployment_table(layout)
        table["timeouts"] = {"dispatch_s": 1.5, "step_s": 40.0, "heartbeat_interval_s": 0.25}
        config_path = tmp_dir / "moemesh.toml"
        write_deployment_file(config_path, table)
        program_conf = tmp_dir / "moemesh.conf"
        program_conf.write_text(program_conf_for(tmp_dir, config_path, self.log_dir))
        self.main_conf = tmp_dir / "supervisord.conf"
        self.main_conf.write_text(
            f"[supervisord]\nnodaemon=true\nlogfile={tmp_dir}/supervisord.log\npidfile={tmp_dir}/supervisord.pid\n"
            f"childlogdir={tmp_dir}\n"
            f"[unix_http_server]\nfile={tmp_dir}/supervisor.sock\n"
            f"[supervisorctl]\nserverurl=unix://{tmp_dir}/supervisor.sock\n"
            f"[rpcinterface:supervisor]\n"
            f"supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n"
            f"[include]\nfiles = {program_conf}\n")
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self.process = subprocess.Popen([str(SUPERVISORD_BIN), "-c", str(self.main_conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)

    def ctl(self, *args: str) -> str:
        return subprocess.run([str(SUPERVISORCTL_BIN), "-c", str(self.main_conf), *args],
                              capture_output=True, text=True, timeout=30).stdout.strip()

    def pid_of(self, program: str) -> int | None:
        text = self.ctl("pid", program)
        return int(text) if text.isdigit() and int(text) > 0 else None

    def health(self) -> int:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    def wait_healthy(self, timeout_s: float) -> bool:
        return wait_until(lambda: self.health() == 200, timeout_s, poll_s=0.25)

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}"
                         for path in sorted(self.log_dir.glob("*.log")) + [self.tmp_dir / "supervisord.log"]
                         if path.exists()) + "\n" + self.ctl("status")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)  # supervisord stops every program (TERM, then KILL)
        try:
            self.process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@pytest.fixture(scope="module")
def supervised(checkpoint, tmp_path_factory):
    running = Supervised(checkpoint, tmp_path_factory.mktemp("supervised"))
    try:
        if not running.wait_healthy(240):
            pytest.fail(f"not healthy under supervisord:\n{running.logs()}")
        yield running
    finally:
        running.stop()


def _complete(supervised: Supervised, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{supervised.base_url}/v1/completions", timeout=120, json={
        "model": "kjv-tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})


def test_supervisord_serves_requests(supervised, checkpoint):
    reply = _complete(supervised, 12)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == _reference_text(checkpoint, PROMPT, 12)
    programs = ("moemesh-router", "moemesh-attention-0", "moemesh-expert-0", "moemesh-expert-1")
    deadline = time.monotonic() + 30  # supervisord says STARTING until startsecs (5 s) have passed
    while True:
        status = supervised.ctl("status")
        running = [any(p in line and "RUNNING" in line for line in status.splitlines()) for p in programs]
        if all(running) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(running), status


def test_sigkilled_expert_is_restarted_and_the_stream_ends_cleanly(supervised, checkpoint):
    max_tokens = 48
    expected = _reference_text(checkpoint, PROMPT, max_tokens)
    old_pid = supervised.pid_of(KILLED)
    assert old_pid is not None, supervised.ctl("status")
    pieces, finish_reason, killed = [], None, False
    body = {"model": "kjv-tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started_s = time.monotonic()
    with httpx.stream("POST", f"{supervised.base_url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:  # the cause of a finish_reason "error", as its own event
                continue
            choice = chunk["choices"][0]
            pieces.append(choice["text"])
            finish_reason = choice.get("finish_reason") or finish_reason
            if not killed and len(pieces) == 3:
                os.kill(old_pid, signal.SIGKILL)  # supervisord, not the test, must bring it back
                killed = True
    assert killed, "the stream ended before the kill"
    assert time.monotonic() - started_s < 120, "the stream hung"
    print(f"supervised recovery outcome: finish_reason={finish_reason}")
    assert finish_reason in ("length", "stop", "error"), finish_reason
    if finish_reason != "error":
        assert "".join(pieces) == expected

    assert wait_until(lambda: supervised.pid_of(KILLED) not in (None, old_pid), 60, poll_s=0.5), supervised.logs()
    assert supervised.wait_healthy(120), supervised.logs()
    later = _complete(supervised, 16)
    assert later.status_code == 200, later.text
    assert later.json()["choices"][0]["text"] == _reference_text(checkpoint, PROMPT, 16)
