"""The pieces behind `moemesh serve`'s defaults, in process: `--devices auto`, API keys from
flags, a file and MOEMESH_API_KEY, `--model` as a hub id from an offline hub cache, and the
X-Request-Id middleware's rules."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from moemesh.commands.devices import auto_devices
from moemesh.commands.serve_model import HubModelMissing, is_hub_id, resolve_model
from moemesh.common.security.api_keys import ApiKeyError, collect_api_keys, load_api_keys
from hub_cache_support import COMMIT, fill_hub_cache
from moemesh.services.router.request_id import MAX_REQUEST_ID_CHARS, accepted_request_id, install_request_ids
from spec_support import DEFAULT_MODEL, REPO_ROOT


def test_auto_devices_takes_every_gpu_else_the_cpu():
    assert auto_devices(lambda: 0) == ("cpu",)
    assert auto_devices(lambda: 3) == ("cuda:0", "cuda:1", "cuda:2")


def test_devices_command_shows_what_auto_picks():
    done = subprocess.run([sys.executable, "-m", "moemesh.cli", "devices", "--json"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    entries = json.loads(done.stdout)
    chosen = [entry["device"] for entry in entries if entry["serve_auto"]]
    cuda = [entry["device"] for entry in entries if entry["device"].startswith("cuda:")]
    assert chosen == (cuda or ["cpu"])


def test_devices_table_names_the_auto_choice(monkeypatch, capsys):
    from moemesh.commands import devices

    monkeypatch.setattr(devices, "list_devices", lambda: [
        {"device": "cuda:0", "name": "GPU", "total_bytes": 2**30, "free_bytes": 2**30},
        {"device": "cuda:1", "name": "GPU", "total_bytes": 2**30, "free_bytes": 2**30},
        {"device": "cpu", "name": "host CPU", "total_bytes": None, "free_bytes": None}])
    assert devices.run(argparse.Namespace(json=False)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "moemesh serve --devices auto uses: cuda:0,cuda:1"
    assert lines[1].endswith("(serve --devices auto)") and not lines[3].endswith("(serve --devices auto)")


def test_api_keys_from_flags_file_and_environment(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nfile-key-0123456789abcdef\n\n")
    keys = collect_api_keys(["flag-key-0123456789abcdef"], key_file, {"MOEMESH_API_KEY": " env-key-0123456789abc \n"})
    assert keys == ("flag-key-0123456789abcdef", "file-key-0123456789abcdef", "env-key-0123456789abc")
    api_keys = load_api_keys([], None, {"MOEMESH_API_KEY": "env-key-0123456789abc"})
    assert api_keys.matches("env-key-0123456789abc") and not api_keys.matches("other")
    assert load_api_keys([], None, {"MOEMESH_API_KEY": ""}) is None
    with pytest.raises(ApiKeyError, match="MOEMESH_API_KEY"):
        collect_api_keys((), None, {"MOEMESH_API_KEY": "has space"})


def test_hub_id_resolves_from_an_offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = fill_hub_cache(tmp_path, "org/kjv-mini", DEFAULT_MODEL)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert is_hub_id("org/kjv-mini") and not is_hub_id(str(DEFAULT_MODEL)) and not is_hub_id("./x/y")
    assert resolve_model("org/kjv-mini") == snapshot
    assert resolve_model("org/kjv-mini", COMMIT) == snapshot  # pinned by commit
    assert resolve_model(str(DEFAULT_MODEL)) == DEFAULT_MODEL
    with pytest.raises(HubModelMissing, match=r"'org/kjv-mini' \(revision v2\).*HF_HUB_OFFLINE"):
        resolve_model("org/kjv-mini", "v2")
    with pytest.raises(HubModelMissing, match=r"no checkpoint directory org/absent; as a hub id"):
        resolve_model("org/absent")
    with pytest.raises(HubModelMissing, match="local directory"):
        resolve_model(str(DEFAULT_MODEL), "main")


@pytest.mark.parametrize("raw, kept", [
    (b"abc-123", "abc-123"), (b"  spaced id  ", "spaced id"), (b"x" * MAX_REQUEST_ID_CHARS, "x" * MAX_REQUEST_ID_CHARS),
    (b"x" * (MAX_REQUEST_ID_CHARS + 1), None), (b"", None), (b"   ", None), (b"bad\x01id", None),
    ("caf\u00e9".encode(), None), (None, None),
])
def test_request_id_rules(raw, kept):
    assert accepted_request_id(raw) == kept


def test_request_id_header_on_every_response():
    async def ok(_):
        return JSONResponse({"ok": True})

    async def refused(_):
        return JSONResponse({"error": {}}, status_code=400, headers={"X-Request-Id": "from-the-app"})

    app = Starlette(routes=[Route("/ok", ok), Route("/refused", refused)])
    install_request_ids(app)
    client = TestClient(app)
    assert client.get("/ok", headers={"X-Request-Id": "mine-1"}).headers["x-request-id"] == "mine-1"
    made = client.get("/ok").headers["x-request-id"]
    assert len(made) == 32 and made != client.get("/ok").headers["x-request-id"]
    answer = client.get("/refused", headers={"X-Request-Id": "mine-2"})
    assert answer.headers.get_list("x-request-id") == ["mine-2"]  # one header, the request's id
