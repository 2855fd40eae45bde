"""Hostile request bodies never reach a 5xx and never stall the server: nesting depth and body
size are refused before parsing, a prompt that cannot fit the context before tokenizing, and
`/health` answers within 1 s while a 20 MiB request is being refused (a real uvicorn gateway in
a child process, `ops_hostile_support`).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_support import ScriptedEngine, tiny_tokenizer
from starlette.testclient import TestClient

from moemesh.common.chat import tokens as tk
from moemesh.services.router.app import build_app
from moemesh.services.router.gateway_config import GatewayConfig
from moemesh.services.router.protocol import nesting_exceeds

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)
MAX_HEALTH_LATENCY_S = 1.0


def make(**config):
    engine = ScriptedEngine(TOKENIZER.encode("Hello", add_special_tokens=False).ids + [EOS], eos_id=EOS)
    fields = dict(model_name="m", max_model_len=256, eos_token_ids=(EOS,), keep_alive_interval_s=0.1, **config)
    return engine, TestClient(build_app(GatewayConfig(**fields), engine, TOKENIZER))


ENGINE, CLIENT = make(max_body_bytes=64 * 1024, max_json_depth=16)


def _post(path: str, raw: bytes, headers: dict | None = None):
    return CLIENT.post(path, content=raw, headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("depth", [17, 1000, 9_000])
def test_deep_nesting_is_a_400_json_error(path, depth):
    for raw in (b"[" * depth + b"]" * depth, b'{"prompt": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}",
                b'{"messages": ' + b"[" * depth):  # unterminated too
        response = _post(path, raw)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "nesting_too_deep"


def test_nesting_at_the_limit_and_brackets_in_strings_are_fine():
    at_limit = {"prompt": "hi", "stop": None, "user": json.loads("[" * 14 + "]" * 14) and "u"}
    assert CLIENT.post("/v1/completions", json=at_limit).status_code == 200
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "[{" * 5000 + '\\"]'}]}],
            "max_tokens": 2}
    response = CLIENT.post("/v1/chat/completions", json=body)
    assert response.status_code in (200, 400) and "nesting" not in response.text  # 400 only for the context


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab', max_size=6),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text('[]{}"\\k', max_size=3),
                                                                                  inner, max_size=4),
                     max_leaves=40)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(_JSON, st.integers(0, 8))
def test_the_depth_scan_agrees_with_the_parsed_depth(value, max_depth):
    raw = json.dumps(value, ensure_ascii=False).encode()
    assert nesting_exceeds(raw, max_depth) == (_depth(value) > max_depth)


def test_bodies_over_the_limit_are_413_before_they_are_read():
    big = json.dumps({"prompt": "x" * 70_000}).encode()
    response = _post("/v1/completions", big)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: refused while it streams in
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    response = CLIENT.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


@pytest.mark.parametrize("extra", [
    {"stop": ["a"] * 300_000},  # strings
    {"metadata": [[]] * 70_000},  # arrays (an unknown field still counts: the scan runs before parsing)
    {"prompt": [7] * 2_200_000},  # values
])
def test_bodies_with_too_many_values_are_400_before_parsing(extra):
    _, client = make()  # the default limits
    response = client.post("/v1/completions", json={"prompt": "hi", **extra})
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_values", response.text[:300]


@pytest.mark.parametrize("raw", [
    b"", b"null", b"[]", b'"text"', b"{", b'{"prompt": "\\ud800"}', b'{"prompt": 1e999999}',
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", b"\xff\xfe", b'{"prompt": NaN}',
])
def test_malformed_bodies_are_400(raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = _post(path, raw)
        assert response.status_code == 400, (raw[:40], response.status_code, response.text[:200])
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_limits_and_drain_timeout_reach_the_router_from_the_command_line(tmp_path):
    from pathlib import Path

    from tokenizers import Tokenizer

    from moemesh.cli import build_parser
    from moemesh.commands.serve_args import request_limits
    from moemesh.commands.serve_config import ServeLayout, write_deployment
    from moemesh.commands.service import deployment_overrides
    from moemesh.common.runtime.deployment import load_deployment
    from moemesh.services.router.main import build_configs

    model_dir = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--max-body-bytes", "4096", "--max-json-depth", "8",
                              "--max-concurrent-tokenizations", "3", "--drain-timeout", "7"])
    config_path, deployment = write_deployment(ServeLayout(
        model_path=str(model_dir), run_dir=str(tmp_path), log_dir=str(tmp_path / "logs"), drain_s=args.drain_timeout,
        router_limits=request_limits(args)))
    assert deployment.timeouts.drain_s == 7.0
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    gateway = build_configs(deployment, tokenizer).gateway
    assert (gateway.max_body_bytes, gateway.max_json_depth, gateway.max_concurrent_tokenizations) == (4096, 8, 3)
    assert gateway.prompt_tokens.prefix_ids == (tokenizer.token_to_id(tk.BOS),)  # tokenizer_config.json: add_bos_token
    router_args = parser.parse_args(["router", "--config", str(config_path), "--max-json-depth", "12"])
    assert load_deployment(config_path, deployment_overrides(router_args)).router.max_json_depth == 12


# ------------------------------------------------------------------ a real server under a 20 MiB body
@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from ops_hostile_support import ledger_gateway

    # context 200k tokens: a 20 MiB prompt is refused from its byte count, 1 MiB is tokenized
    with ledger_gateway(tmp_path_factory.mktemp("limits") / "gateway.stderr", max_model_len=200_000) as served:
        yield served


class _HealthProbe:
    """Polls /health from its own connection and keeps the slowest answer."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.latencies_s: list[float] = []
        self.statuses: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                start = time.monotonic()
                self.statuses.add(http.get(f"{self.base_url}/health").status_code)
                self.latencies_s.append(time.monotonic() - start)
                self._stop.wait(0.05)

    def __enter__(self) -> "_HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(30)


def test_health_answers_within_a_second_while_20_mib_requests_are_refused(gateway):
    process, base_url = gateway
    words = "The quick brown fox jumps over the lazy dog. "
    big_prompt = json.dumps({"prompt": words * (20 * 2**20 // len(words)), "max_tokens": 4}).encode()
    deep = b'{"prompt": ' + b"[" * (20 * 2**20) + b"]" * 10 + b"}"
    tokenized = json.dumps({"prompt": words * (2**20 // len(words)), "max_tokens": 4}).encode()
    message = {"role": "user", "content": "The quick brown fox"}
    many_messages = json.dumps({"messages": [message] * (20 * 2**20 // len(json.dumps(message)))}).encode()
    results: dict[str, tuple[int, dict, float]] = {}

    def send(name: str, raw: bytes, path: str = "/v1/completions") -> None:
        start = time.monotonic()
        response = httpx.post(f"{base_url}{path}", content=raw, timeout=120,
                              headers={"content-type": "application/json"})
        results[name] = (response.status_code, response.json(), time.monotonic() - start)

    with _HealthProbe(base_url) as probe:
        senders = [threading.Thread(target=send, args=item) for item in
                   (("20 MiB prompt", big_prompt), ("20 MiB nesting", deep), ("1 MiB prompt", tokenized),
                    ("20 MiB of messages", many_messages, "/v1/chat/completions"))]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(120)
    assert process.poll() is None
    print({name: (status, f"{seconds:.2f} s") for name, (status, _, seconds) in results.items()},
          f"/health: {len(probe.latencies_s)} answers, slowest {max(probe.latencies_s):.3f} s")
    assert results["20 MiB prompt"][0] == 400 and results["20 MiB prompt"][1]["error"]["code"] == "context_length_exceeded"
    assert "at least" in results["20 MiB prompt"][1]["error"]["message"]  # refused before tokenizing
    assert results["20 MiB nesting"][0] == 400 and results["20 MiB nesting"][1]["error"]["code"] == "nesting_too_deep"
    assert results["1 MiB prompt"][0] in (200, 400), results["1 MiB prompt"]  # tokenized in a worker thread
    assert results["20 MiB of messages"][0] == 400, results["20 MiB of messages"]  # parsed in a worker thread
    assert probe.statuses == {200} and len(probe.latencies_s) >= 3
    assert max(probe.latencies_s) < MAX_HEALTH_LATENCY_S, sorted(probe.latencies_s)[-5:]
