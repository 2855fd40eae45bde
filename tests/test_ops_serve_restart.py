"""`moemesh serve` on the default model restarts a child that dies, and serving goes on.

- expert worker SIGKILLed while three greedy streams run: serve restarts it (new pid, /health
  and /status.json count the restart, `serve.child_restarted` in serve's log); every stream ends
  in bounded time, either complete with exactly the reference text (the attention worker retried
  the lost step on the restarted worker) or with finish_reason "error"; a later request returns
  the reference text.
- attention worker SIGKILLed mid-stream: the stream fails as soon as the new worker's Ready
  arrives (the router does not wait out the step timeout) with an error event naming the
  restart, the router starts its KV bookkeeping afresh, so a prompt that was a prefix-cache hit
  before is computed again (cached_tokens 0) and its text equals the reference;
- the router SIGKILLed: restarted, it serves again; then the attention worker SIGKILLed and a
  request sent at once: it waits for the restarted worker and returns 200 (within 120 s), so
  does the next, and the restarted router still notices the attention restart (cache afresh);
- a service dying more often than `--max-restarts` allows stops serve with exit code 1.
References come from the same server before any kill (greedy, ignore_eos: deterministic).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from moemesh.bench.soak import child_pids
from spec_support import DEFAULT_MODEL, start_serve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not any(DEFAULT_MODEL.glob("*.safetensors")), reason="default model weights missing"),
]

MODEL = "kjv-dsv4-mini"
VERSE = "And God said, Let there be light: and there was light. And God saw the light, that it was good. "
LONG_PROMPT = VERSE * 8  # > one 128-token KV block: a repeat of it is a prefix-cache hit
PROMPTS = ("In the beginning God", "The LORD is my shepherd;")
STREAM_TOKENS = 24
# the expert-kill streams run long enough that steps remain after the kill, whatever the load
KILL_STREAM_TOKENS = 96


def _serve(tmp_path_factory, *args):
    # the experts in expert-0 (not in the attention worker, serve's one-device default): its kills matter
    server = start_serve(tmp_path_factory.mktemp("restart"), "--experts-in-attention", "none", *args)
    if "moemesh serving" not in server.first_line:
        server.stop()
        pytest.fail(f"serve did not start: {server.first_line!r}\n{server.logs()}")
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = _serve(tmp_path_factory)
    yield server
    assert server.stop() == 0, server.logs()


def _complete(server, prompt: str, max_tokens: int) -> dict:
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _post_all(server, requests: list[tuple[str, dict]]) -> list[dict]:
    """The replies to (path, body) requests sent at once (the engine decodes them in the same steps;
    greedy outputs do not depend on what shares a step), each asserted 200."""
    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(client.post(f"{server.base_url}{path}", json={"model": MODEL, **body})
                                          for path, body in requests))

    replies = asyncio.run(post_all())
    for reply in replies:
        assert reply.status_code == 200, reply.text
    return [reply.json() for reply in replies]


def _texts(server, prompts, max_tokens: int) -> dict[str, str]:
    """Greedy ignore_eos texts of `prompts`, requested at once."""
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    replies = _post_all(server, [("/v1/completions", {**body, "prompt": prompt}) for prompt in prompts])
    return {prompt: reply["choices"][0]["text"] for prompt, reply in zip(prompts, replies)}


def _pid(server, name: str) -> int | None:
    """The pid of serve's child running service `name` (from /proc: the router is not on
    /status.json, and a restarted router knows running workers' pids only from new Readys)."""
    return child_pids(server.process.pid).get(name)


def _status_pid(server, name: str) -> int | None:
    rows = httpx.get(f"{server.base_url}/status.json", timeout=10).json()["services"]
    return next((row["pid"] for row in rows if row["name"] == name), None)


def _wait_restarted(server, name: str, old_pid: int, timeout_s: float = 180.0) -> dict:
    """/health once serve runs a new process for `name` and, for a worker, its Ready reached the
    router (the pid on /status.json comes from the Ready)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            new_pid = _pid(server, name)
            health = httpx.get(f"{server.base_url}/health", timeout=5)
            if health.status_code == 200 and new_pid not in (None, old_pid) and (
                    name == "router" or _status_pid(server, name) == new_pid):
                return health.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{name} was not restarted and healthy within {timeout_s}s\n{server.logs()}")


async def _stream(client: httpx.AsyncClient, server, prompt: str, first_chunk: asyncio.Event,
                  max_tokens: int, errors: list[str] | None = None, request_id: str | None = None) -> tuple[str, str]:
    """(text, finish_reason) of one greedy stream; error events' messages go to `errors`."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    pieces, finish_reason = [], None
    headers = {"X-Request-Id": request_id} if request_id else {}
    async with client.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        assert request_id is None or reply.headers["x-request-id"] == request_id
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                if errors is not None:
                    errors.append(payload["error"]["message"])
                continue
            choice = payload["choices"][0]
            pieces.append(choice["text"])
            finish_reason = choice.get("finish_reason") or finish_reason
            if len(pieces) >= 2:
                first_chunk.set()
    return "".join(pieces), finish_reason


async def _streams_with_kill(server, prompts, pid: int, max_tokens: int = STREAM_TOKENS,
                             errors: list[str] | None = None) -> list[tuple[str, str]]:
    """Stream `prompts` (X-Request-Id `kill-<pid>-<index>`), SIGKILL `pid` once each sent a chunk."""
    started = [asyncio.Event() for _ in prompts]
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(_stream(client, server, prompt, event, max_tokens, errors, f"kill-{pid}-{index}"))
                 for index, (prompt, event) in enumerate(zip(prompts, started))]
        waiting = asyncio.gather(*(event.wait() for event in started))
        done, _ = await asyncio.wait([waiting, *tasks], timeout=240, return_when=asyncio.FIRST_COMPLETED)
        assert waiting in done, [task.result() for task in tasks if task in done]  # a stream ended early
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)  # none may hang


def _serve_events(server, name: str = "serve") -> list[dict]:
    path = server.run_dir / "logs" / f"{name}.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_ignore_eos_generates_and_shows_text_past_eos(server):
    """(Runs first: the premise of the greedy references below.) On the default model, greedy
    "The LORD is my shepherd;" ends at once with EOS and chat "Recite John 11:35" after
    "Jesus wept."; with ignore_eos both go on to max_tokens, and chat shows the text after EOS
    (without the EOS / BOS markers), extending the text it showed without ignore_eos."""
    body = {"prompt": "The LORD is my shepherd;", "max_tokens": 12, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "Recite John 11:35"}], "max_tokens": 24, "temperature": 0}
    stopped, ignored, short, long = _post_all(server, [
        ("/v1/completions", body), ("/v1/completions", {**body, "ignore_eos": True}),
        ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "ignore_eos": True})])
    assert stopped["choices"][0]["finish_reason"] == "stop", stopped
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 12
    assert ignored["choices"][0]["text"].strip()
    short, long = short["choices"][0], long["choices"][0]
    assert short["finish_reason"] == "stop" and long["finish_reason"] == "length"
    shown, more = short["message"]["content"], long["message"]["content"]
    assert more.startswith(shown) and len(more.strip()) > len(shown.strip()) + 10, (shown, more)
    assert "<｜" not in more  # no end/begin-of-sentence markers in chat content


def test_sigkilled_expert_worker_is_restarted_and_streams_end_cleanly(server):
    reference = _texts(server, PROMPTS, KILL_STREAM_TOKENS)
    old_pid = _pid(server, "expert-0")
    assert old_pid is not None
    outcomes = asyncio.run(_streams_with_kill(server, PROMPTS, old_pid, max_tokens=KILL_STREAM_TOKENS))
    for prompt, (text, finish_reason) in zip(PROMPTS, outcomes):
        print(f"expert kill: {prompt!r} ended with {finish_reason}")
        assert finish_reason in ("length", "error"), finish_reason
        if finish_reason == "length":
            assert text == reference[prompt]  # the lost step was retried exactly
    # the attention worker's warning names the worker and the HTTP requests (X-Request-Id) it touched: a
    # lost step (no reply within the dispatch timeout), or a stalled reply when the restarted worker
    # answered the queued Dispatch before the timeout
    faults = [e for e in _serve_events(server, "attention-0")
              if e["event"] in ("attention.step_lost_expert", "attention.expert_reply_stalled")]
    assert faults and faults[0]["level"] == "warning", faults[:1]
    assert "expert-0" in faults[0].get("worker", faults[0].get("endpoint", "")), faults[0]
    assert {f"kill-{old_pid}-{index}" for index in range(len(PROMPTS))} & set(faults[0]["request_ids"]), faults[0]
    health = _wait_restarted(server, "expert-0", old_pid)
    assert health["restarts"] == {"expert-0": 1}
    status = httpx.get(f"{server.base_url}/status.json", timeout=10).json()
    assert status["restarts"]["expert-0"]["last_exit_code"] == -signal.SIGKILL
    new_pid = _pid(server, "expert-0")
    assert status["restarts"]["expert-0"]["pid"] == new_pid
    assert _status_pid(server, "expert-0") == new_pid  # its new Ready
    restarted = [e for e in _serve_events(server) if e["event"] == "serve.child_restarted"]
    assert [e["name"] for e in restarted] == ["expert-0"] and restarted[0]["pid"] == _pid(server, "expert-0")
    assert _texts(server, PROMPTS, KILL_STREAM_TOKENS) == reference


def test_sigkilled_attention_worker_fails_fast_and_prefix_cache_starts_afresh(server):
    first = _complete(server, LONG_PROMPT, 12)
    again = _complete(server, LONG_PROMPT, 12)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the premise: a prefix hit
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    old_pid = _pid(server, "attention-0")
    errors: list[str] = []
    outcomes = asyncio.run(_streams_with_kill(server, PROMPTS[:1], old_pid, max_tokens=200, errors=errors))
    assert outcomes[0][1] == "error"  # the attention worker's state died with it
    assert len(errors) == 1 and "the attention worker restarted" in errors[0], errors  # the cause, in the stream
    engine = httpx.get(f"{server.base_url}/status.json", timeout=10).json()["engine"]
    # its requests failed cleanly and freed everything: nothing running or queued, no KV block held
    assert engine["num_running"] == 0 and engine["num_waiting"] == 0, engine
    assert engine["kv_blocks_used"] == {"gpu": 0, "cpu": 0}, engine
    _wait_restarted(server, "attention-0", old_pid, timeout_s=180)
    after = _complete(server, LONG_PROMPT, 12)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no hit on blocks the new worker lacks
    assert after["choices"][0]["text"] == first["choices"][0]["text"]
    events = [json.loads(line) for line in (server.run_dir / "logs" / "router.log").read_text().splitlines()
              if line.startswith("{")]
    assert any(e["event"] == "router.attention_restarted" for e in events)
    # failed by the new worker's Ready (a step in flight, or the open requests between steps), never by
    # the 30 s step timeout
    assert not any(e["event"] == "router.step_failed" and "did not answer within" in e["reason"] for e in events)


def test_restarted_router_serves_and_waits_for_an_attention_restart(server):
    """Router SIGKILL, wait for /health, attention-worker SIGKILL, then a request at once: it waits
    for the restarted worker (bounded by the recovery timeout) and returns 200 within 120 s, and so
    does the next. A restarted router knows the running workers only from heartbeats (a Ready
    comes once per process); a Ready after its first steps is a new attention worker, so the
    prefix cache starts afresh."""
    old_router = _pid(server, "router")
    os.kill(old_router, signal.SIGKILL)
    _wait_restarted(server, "router", old_router)
    first = _complete(server, LONG_PROMPT, 12)
    assert _complete(server, LONG_PROMPT, 12)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    old_pid = _pid(server, "attention-0")
    os.kill(old_pid, signal.SIGKILL)
    sent_s = time.monotonic()
    after = _complete(server, LONG_PROMPT, 12)
    waited_s = time.monotonic() - sent_s
    print(f"request sent at the attention worker's SIGKILL: 200 after {waited_s:.1f} s")
    assert waited_s < 120.0
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the new worker's pool is empty
    assert after["choices"][0]["text"] == first["choices"][0]["text"]
    assert _complete(server, PROMPTS[0], 8)["usage"]["completion_tokens"] == 8
    assert _pid(server, "attention-0") not in (None, old_pid)
    assert httpx.get(f"{server.base_url}/health", timeout=10).json()["restarts"]["router"] == 1


def test_serve_gives_up_when_the_restart_budget_is_spent(tmp_path_factory):
    server = _serve(tmp_path_factory, "--max-restarts", "1", "--restart-backoff-s", "0.2", "--speculation", "off")
    try:
        first_pid = _pid(server, "expert-0")
        os.kill(first_pid, signal.SIGKILL)
        _wait_restarted(server, "expert-0", first_pid)
        os.kill(_pid(server, "expert-0"), signal.SIGKILL)  # the second death within the window
        assert server.process.wait(timeout=90) == 1
    finally:
        server.stop()
    stderr = (server.run_dir / "serve.stderr").read_text()
    assert "expert-0 exited with code -9 after 1 restarts, each dead within 60s" in stderr and "giving up" in stderr
    assert any(e["event"] == "serve.child_gave_up" for e in _serve_events(server))
