"""`moemesh serve` as users of other servers start it: a hub id from the local hub cache, API keys
from flags, a key file and MOEMESH_API_KEY, the default `--devices auto`, a recovery timeout,
and X-Request-Id on every response and in the JSON logs (real processes, one serve).

- `--model org/name` resolves through huggingface_hub's cache in a temp HF_HOME (filled offline,
  HF_HUB_OFFLINE=1); the deployment names the snapshot and clients use the hub id as model name;
  a hub id or revision missing from the cache stops serve at once (exit 2) naming both.
- every endpoint but /health needs one of the three keys: the API, /metrics, the status page and
  the admin placement endpoint answer 401 without (OpenAI-style body, WWW-Authenticate).
- request ids: a client's X-Request-Id comes back on the response (streaming and 401 included)
  and is bound to the router's log events of that request; a malformed one is replaced; a
  completed, a refused (400) and an aborted request each log one `router.request_finished`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import tomllib

import httpx
import pytest

from moemesh.commands.devices import auto_devices
from hub_cache_support import COMMIT, fill_hub_cache
from spec_support import DEFAULT_MODEL, REPO_ROOT, start_serve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not any(DEFAULT_MODEL.glob("*.safetensors")), reason="default model weights missing"),
]

HUB_ID = "moemesh-test/kjv-mini"
FLAG_KEY, FILE_KEY, ENV_KEY = "flag-key-0123456789abcdef", "file-key-0123456789abcdef", "env-key-0123456789abcdef"


def _hub_env(tmp_path) -> dict[str, str]:
    hf_home = tmp_path / "hf-home"
    fill_hub_cache(hf_home, HUB_ID, DEFAULT_MODEL)
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    key_file = root / "keys"
    key_file.write_text(f"# gateway keys\n{FILE_KEY}\n\n")
    key_file.chmod(0o600)
    server = start_serve(root / "run", "--api-key", FLAG_KEY, "--api-key-file", str(key_file),
                         "--recovery-timeout", "45", "--step-timeout", "75", "--speculation", "off", "--revision", "main",
                         "--long-prefill-tokens", "768", "--shared-prefill-tokens", "128", "--kv-snapshots", "96",
                         model=HUB_ID, env={**_hub_env(root), "MOEMESH_API_KEY": ENV_KEY}, devices=None)
    if "moemesh serving" not in server.first_line:
        server.stop()
        pytest.fail(f"serve did not start: {server.first_line!r}\n{server.logs()}")
    yield server
    assert server.stop() == 0, server.logs()


def _auth(key: str = FLAG_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _router_events(server) -> list[dict]:
    path = server.run_dir / "logs" / "router.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def _wait_for_event(server, predicate, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [event for event in _router_events(server) if predicate(event)]
        if found:
            return found[-1]
        time.sleep(0.1)
    pytest.fail("no such event in router.log")


def test_hub_id_from_the_local_cache_with_default_devices(server):
    assert server.first_line.startswith(f"moemesh serving {HUB_ID} at ")
    deployment = tomllib.loads((server.run_dir / "deployment.toml").read_text())
    assert deployment["model"]["path"].endswith(f"/models--moemesh-test--kjv-mini/snapshots/{COMMIT}")
    assert deployment["model"]["name"] == HUB_ID
    auto = auto_devices()  # the default, --devices auto: every CUDA GPU, else the CPU
    assert [w["device"] for w in deployment["attention"]] == [auto[0]]
    assert [w["device"] for w in deployment["expert"]] == list(auto)  # one expert worker per device
    assert deployment["timeouts"]["recovery_s"] == 45.0
    assert deployment["timeouts"]["step_s"] == 75.0
    assert deployment["scheduler"]["long_prefill_token_threshold"] == 768
    assert deployment["scheduler"]["shared_prefill_token_threshold"] == 128
    assert deployment["kv"]["num_primary_snapshots"] == 96
    assert "api_keys" not in deployment.get("security", {})  # the keys live in a 0600 file, not the TOML
    assert (server.run_dir / "api_keys").stat().st_mode & 0o077 == 0
    models = httpx.get(f"{server.base_url}/v1/models", headers=_auth(), timeout=30).json()
    assert models["data"][0]["id"] == HUB_ID
    reply = httpx.post(f"{server.base_url}/v1/completions", headers=_auth(), timeout=300, json={
        "model": HUB_ID, "prompt": "In the beginning God", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text


def test_every_endpoint_but_health_needs_a_key(server):
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    for key in (FLAG_KEY, FILE_KEY, ENV_KEY):
        assert httpx.get(f"{server.base_url}/v1/models", headers=_auth(key), timeout=30).status_code == 200
    closed = [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/"), ("GET", "/status.json"),
              ("POST", "/v1/completions"), ("POST", "/v1/admin/placement"), ("GET", "/v1/admin/experts")]
    for method, path in closed:
        for headers in ({}, _auth("not-a-key-0123456789")):
            reply = httpx.request(method, f"{server.base_url}{path}", headers=headers, json={}, timeout=30)
            assert reply.status_code == 401, (method, path, reply.status_code)
            assert reply.headers["www-authenticate"] == "Bearer"
            assert reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/metrics", headers=_auth(ENV_KEY), timeout=30).status_code == 200


def test_request_ids_on_responses_and_in_the_logs(server):
    url = f"{server.base_url}/v1/completions"
    body = {"model": HUB_ID, "prompt": "In the beginning God", "max_tokens": 3, "temperature": 0}
    done = httpx.post(url, headers={**_auth(), "X-Request-Id": "trace-completed-01"}, json=body, timeout=300)
    assert done.status_code == 200 and done.headers["x-request-id"] == "trace-completed-01"
    refused = httpx.post(url, headers={**_auth(), "X-Request-Id": "trace-refused-01"},
                         json={**body, "max_tokens": -1}, timeout=60)
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "trace-refused-01"
    unauthorized = httpx.post(url, headers={"X-Request-Id": "trace-401-01"}, json=body, timeout=60)
    assert unauthorized.status_code == 401 and unauthorized.headers["x-request-id"] == "trace-401-01"
    made = httpx.post(url, headers={**_auth(), "X-Request-Id": "x" * 500}, json=body, timeout=300)
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])  # too long: a fresh id instead
    assert re.fullmatch(r"[0-9a-f]{32}", httpx.get(f"{server.base_url}/health", timeout=30).headers["x-request-id"])
    with httpx.stream("POST", url, headers={**_auth(), "X-Request-Id": "trace-aborted-01"}, timeout=300,
                      json={**body, "max_tokens": 200, "stream": True, "ignore_eos": True}) as stream:
        assert stream.status_code == 200 and stream.headers["x-request-id"] == "trace-aborted-01"
        next(stream.iter_lines())  # one chunk, then the client goes away

    finished = {}
    for request_id in ("trace-completed-01", "trace-refused-01", "trace-401-01", "trace-aborted-01"):
        finished[request_id] = _wait_for_event(server, lambda e, rid=request_id: (
            e["event"] == "router.request_finished" and e.get("request_id") == rid))
        assert finished[request_id]["level"] == "info" and finished[request_id]["path"] == "/v1/completions"
    assert [finished[r]["outcome"] for r in finished] == ["completed", "refused", "refused", "aborted"]
    assert (finished["trace-completed-01"]["status"], finished["trace-refused-01"]["status"]) == (200, 400)
    events = _router_events(server)
    # the refusal's own event and the key check's carry the request id too
    assert any(e["event"] == "router.request_refused" and e.get("request_id") == "trace-refused-01" for e in events)
    assert any(e["event"] == "router.auth_rejected" and e.get("request_id") == "trace-401-01" for e in events)
    _wait_for_event(server, lambda e: e["event"] == "router.requests_aborted" and "trace-aborted-01" in e["request_ids"])
    assert any(e["event"] == "router.request_id_refused" for e in events)


@pytest.mark.parametrize("flag, value, message", [("--long-prefill-tokens", "0", ">= 1, got 0"),
                                                  ("--shared-prefill-tokens", "0", ">= 1, got 0"),
                                                  ("--kv-snapshots", "-1", ">= 0, got -1")])
def test_bad_chunk_and_snapshot_counts_are_refused_before_anything_starts(tmp_path, flag, value, message):
    command = [sys.executable, "-m", "moemesh.cli", "serve", "--model", str(DEFAULT_MODEL), "--run-dir",
               str(tmp_path / "run"), flag, value]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=_base_env())
    assert done.returncode == 2, done.stderr
    assert f"{flag} must be {message}" in done.stderr


@pytest.mark.parametrize("model, revision", [("moemesh-test/not-cached", None), (HUB_ID, "v9.9")])
def test_a_hub_id_missing_offline_stops_serve_naming_it(tmp_path, model, revision):
    command = [sys.executable, "-m", "moemesh.cli", "serve", "--model", model, "--run-dir", str(tmp_path / "run"),
               *(("--revision", revision) if revision else ())]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**_base_env(), **_hub_env(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert f"'{model}' (revision {revision or 'main'})" in done.stderr and "HF_HUB_OFFLINE" in done.stderr
    assert "not in the local Hugging Face cache" in done.stderr


def _base_env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
