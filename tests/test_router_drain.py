"""The gateway's stop sequence (what the router runs on SIGTERM, services/router/main.py): once
draining, new requests get 503 with Retry-After while open ones go on; cutting ends a stream
with a final error chunk, an error event and [DONE], and a non-streaming request with a 503."""

from __future__ import annotations

import json
import threading
import time

from router_support import ScriptedEngine, tiny_tokenizer
from starlette.testclient import TestClient

from moemesh.common.chat import tokens as tk
from moemesh.services.router.app import build_app
from moemesh.services.router.gateway_config import GatewayConfig

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_drain_refuses_new_requests_and_cut_ends_open_ones_with_an_error():
    script = TOKENIZER.encode("The quick brown fox jumps over the lazy dog. " * 8, add_special_tokens=False).ids
    engine = ScriptedEngine(script, eos_id=EOS, step_delay_s=0.05)
    app = build_app(GatewayConfig(model_name="m", max_model_len=512, eos_token_ids=(EOS,), keep_alive_interval_s=0.1),
                    engine, TOKENIZER)
    gateway = app.state.gateway
    body = {"prompt": "Say hi", "max_tokens": 60, "temperature": 0}
    with TestClient(app) as client:
        results: dict[str, object] = {}

        def stream() -> None:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                results["stream"] = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]

        def plain() -> None:
            results["plain"] = client.post("/v1/completions", json=body)

        threads = [threading.Thread(target=t) for t in (stream, plain)]
        for thread in threads:
            thread.start()
        _wait(lambda: len(engine.submitted) == 2)
        client.portal.call(gateway.begin_drain)
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "shutting_down"
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert len(engine.submitted) == 2 and gateway.num_open_requests == 2
        assert not client.portal.call(gateway.wait_closed, 0.2)  # still generating

        client.portal.call(gateway.cut_open_requests, "the server is shutting down")
        for thread in threads:
            thread.join(10)
        assert client.portal.call(gateway.wait_closed, 5.0)
        lines = results["stream"]
        assert lines[-1] == "[DONE]"
        assert json.loads(lines[-3])["choices"][0]["finish_reason"] == "error"
        assert json.loads(lines[-2])["error"]["message"] == "the server is shutting down"
        plain_answer = results["plain"]
        assert plain_answer.status_code == 503 and "shutting down" in plain_answer.json()["error"]["message"]
        assert sorted(engine.aborted) == sorted(r.request_id for r in engine.submitted)  # the engine stops them


def test_requests_open_when_the_drain_begins_finish_normally():
    script = TOKENIZER.encode("Hello world", add_special_tokens=False).ids
    engine = ScriptedEngine(script, eos_id=EOS, step_delay_s=0.05)
    app = build_app(GatewayConfig(model_name="m", max_model_len=512, eos_token_ids=(EOS,)), engine, TOKENIZER)
    gateway = app.state.gateway
    with TestClient(app) as client:
        answer: list = []
        thread = threading.Thread(target=lambda: answer.append(client.post(
            "/v1/completions", json={"prompt": "Say hi", "max_tokens": 3, "temperature": 0})))
        thread.start()
        _wait(lambda: engine.submitted)
        client.portal.call(gateway.begin_drain)
        assert client.portal.call(gateway.wait_closed, 10.0)
        thread.join(10)
        assert answer[0].status_code == 200 and answer[0].json()["choices"][0]["finish_reason"] == "length"
