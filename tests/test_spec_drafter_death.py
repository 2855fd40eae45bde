"""The draft worker dies while serving, then comes back ("nothing silent").

The router, attention worker, expert worker and draft worker run as separate processes on the
default model, started here the way `moemesh serve` starts them (same deployment file, same
process launcher) so the test owns the draft worker's process. Greedy requests stream; once
their drafts are being verified, the draft worker is SIGKILLed. Then:
- the streams complete, each text equal to the single-process greedy reference (no drafts), and
  usage.speculative says what happened to each (ran, with the drafts it had verified);
- /health stays 200 with the drafter's entry "down: ...", the router log has the failure event;
- later requests are served without speculation (usage.speculative.ran false), still equal;
- a restarted draft worker is picked up (/health "ok", `router.drafter_recovered` in the log)
  and speculation resumes (ran true, drafts verified), outputs still equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from spec_support import DEFAULT_MODEL, free_port

pytestmark = [
    pytest.mark.slow,  # four processes, a kill and a restart: ~45 s on an idle 2-core host
    pytest.mark.timeout(600),
    pytest.mark.skipif(not any(DEFAULT_MODEL.glob("*.safetensors")), reason="default model weights missing"),
]

EOS_ID = 1
MAX_TOKENS = 32
PROMPTS = ["Psalms 119:1 Blessed are the", "Genesis 1:1 In the beginning God"]


@pytest.fixture(scope="module")
def reference():
    """Greedy text of every prompt from the single-process reference model (no speculation)."""
    from tokenizers import Tokenizer

    from moemesh.commands.generate import _load_model
    from moemesh.common.model.generate import GenerationConfig, generate_batch
    from moemesh.services.router.detokenizer import IncrementalDetokenizer, TokenBytes

    model, _ = _load_model(str(DEFAULT_MODEL), "float32", "cpu")
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    texts = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=True).ids  # as the server: BOS first
        tokens = generate_batch(model, [ids], GenerationConfig(max_new_tokens=MAX_TOKENS, stop_token_ids=(EOS_ID,)))[0]
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, token_bytes=TokenBytes(tokenizer))
        texts[prompt] = detokenizer.add(tokens) + detokenizer.finish()
    return texts


@contextlib.contextmanager
def _one_thread_children():
    """Children started inside run torch on one thread: four processes whose intra-op threads
    spin-wait for each other on a 2-core CI host made every step many times slower."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous


class Stack:
    """router + attention + expert + draft processes from one deployment file."""

    def __init__(self, run_dir: Path) -> None:
        from moemesh.commands.serve_config import ServeLayout, write_deployment

        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.config_path, _ = write_deployment(ServeLayout(
            model_path=str(DEFAULT_MODEL), run_dir=str(run_dir), log_dir=str(self.log_dir), port=port,
            with_drafter=True, draft_placement="process"))
        self.services = []
        self.drafter = None

    def start(self) -> None:
        from moemesh.common.runtime.launcher import start_service

        with _one_thread_children():
            for role, name in (("router", "router"), ("attention", "attention-0"), ("expert", "expert-0")):
                self.services.append(start_service(role, name, self.config_path, self.log_dir))
        self.start_drafter()

    def start_drafter(self) -> None:
        from moemesh.common.runtime.launcher import start_service

        with _one_thread_children():
            self.drafter = start_service("draft", "draft", self.config_path, self.log_dir,
                                         extra_args=("--speculation", "adaptive", "--spec-width", "5"))

    def health(self) -> tuple[int, dict]:
        try:
            reply = httpx.get(f"{self.base_url}/health", timeout=5)
        except httpx.HTTPError:
            return 0, {}
        return reply.status_code, reply.json().get("services", {})

    def wait_for(self, predicate, what: str, timeout_s: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for service in self.services:
                assert service.exit_code is None, f"{service.name} exited:\n{service.stderr_tail()}"
            code, services = self.health()
            if predicate(code, services):
                return services
            time.sleep(0.3)
        pytest.fail(f"timed out waiting for {what}: {self.health()}\n{self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}"
                         for path in sorted(self.log_dir.glob("*.stderr")))

    def router_events(self) -> list[dict]:
        events = []
        for line in (self.log_dir / "router.log").read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events

    def stop(self) -> None:
        from moemesh.common.runtime.launcher import stop_services

        stop_services(self.services + ([self.drafter] if self.drafter is not None else []), 20.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("drafter_death"))
    try:
        stack.start()
        stack.wait_for(lambda code, services: code == 200 and services.get("draft") == "ok", "serving with a drafter")
        yield stack
    finally:
        stack.stop()


async def _stream(client: httpx.AsyncClient, base_url: str, prompt: str, progress: dict) -> dict:
    """One streamed greedy completion: its text and its final usage."""
    body = {"model": "kjv-dsv4-mini", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", []):
                text.append(choice.get("text", ""))
            usage = chunk.get("usage") or usage
            progress[prompt] = len(text)
    return {"text": "".join(text), "usage": usage}


async def _complete_all(base_url: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(prompt: str) -> dict:
            reply = await client.post(f"{base_url}/v1/completions", json={
                "model": "kjv-dsv4-mini", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            return {"text": body["choices"][0]["text"], "usage": body["usage"]}
        return await asyncio.gather(*(one(prompt) for prompt in PROMPTS))


def _drafts_verified(base_url: str) -> float:
    status = httpx.get(f"{base_url}/status.json", timeout=5).json()
    return float(sum(status["engine"].get("spec_draft_by_position", [0])))


async def _stream_and_kill(stack: Stack) -> list[dict]:
    progress: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(_stream(client, stack.base_url, prompt, progress)) for prompt in PROMPTS]
        deadline = time.monotonic() + 120
        # kill once every stream has produced a few chunks and drafts are being verified
        while not (len(progress) == len(PROMPTS) and min(progress.values()) >= 3
                   and await asyncio.to_thread(_drafts_verified, stack.base_url) > 0):
            assert time.monotonic() < deadline, f"streams did not start: {progress}"
            assert not any(task.done() for task in tasks), "a stream ended before the drafter was killed"
            await asyncio.sleep(0.05)
        stack.drafter.process.kill()  # SIGKILL: no drain, no goodbye
        return await asyncio.gather(*tasks)


def test_requests_survive_the_drafter_dying_and_speculation_resumes_after_a_restart(stack, reference):
    # 1. the drafter dies while greedy requests stream
    streamed = asyncio.run(_stream_and_kill(stack))
    stack.drafter.process.wait(10)
    for prompt, result in zip(PROMPTS, streamed):
        assert result["text"] == reference[prompt], prompt
        speculative = result["usage"]["speculative"]
        assert speculative["ran"] is (speculative["draft_tokens"] > 0)
    assert any(result["usage"]["speculative"]["ran"] for result in streamed)  # drafts were verified before the kill

    # 2. health says so (still 200: serving goes on), the router log names the failure
    services = stack.wait_for(lambda code, s: code == 200 and s.get("draft", "").startswith("down"),
                              "the drafter reported down", timeout_s=60)
    assert "serving without speculation" in services["draft"]
    failures = [e for e in stack.router_events() if e.get("event") in ("router.drafter_failed", "router.drafter_silent")]
    assert failures and failures[0]["action"] == "serving continues without speculation"

    # 3. later requests: no speculation, same outputs
    for prompt, result in zip(PROMPTS, asyncio.run(_complete_all(stack.base_url))):
        assert result["text"] == reference[prompt], prompt
        assert result["usage"]["speculative"]["ran"] is False and result["usage"]["speculative"]["draft_tokens"] == 0

    # 4. the drafter comes back: speculation resumes
    stack.start_drafter()
    stack.wait_for(lambda code, s: code == 200 and s.get("draft") == "ok", "the restarted drafter", timeout_s=180)
    resumed = asyncio.run(_complete_all(stack.base_url))
    for prompt, result in zip(PROMPTS, resumed):
        assert result["text"] == reference[prompt], prompt
    assert any(r["usage"]["speculative"]["ran"] and r["usage"]["speculative"]["draft_tokens"] > 0 for r in resumed)
    assert any(e.get("event") == "router.drafter_recovered" for e in stack.router_events())
