"""Bearer auth on the real gateway app: 401 without a valid key, open health and metrics,
the OpenAI client's view; and API key loading."""

from __future__ import annotations

import openai
import pytest
from router_support import ScriptedEngine, tiny_tokenizer
from starlette.testclient import TestClient

from moemesh.common.chat import tokens as tk
from moemesh.common.security.api_keys import ApiKeyError, ApiKeys, bearer_token, load_api_keys, read_api_key_file
from moemesh.services.router.app import build_app
from moemesh.services.router.auth_middleware import GatewayAuthConfig, install_bearer_auth
from moemesh.services.router.gateway_config import GatewayConfig

KEY = "mm-test-key-0123456789abcdef"
OTHER_KEY = "mm-second-key-0123456789abcd"
TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)


def _client(open_paths=None, keys=(KEY, OTHER_KEY)):
    engine = ScriptedEngine(TOKENIZER.encode("Hello there.", add_special_tokens=False).ids + [EOS], eos_id=EOS)
    app = build_app(GatewayConfig(model_name="dsv4-flash", max_model_len=256, eos_token_ids=(EOS,)), engine, TOKENIZER)
    config = GatewayAuthConfig(api_keys=ApiKeys.from_keys(keys))
    if open_paths is not None:
        config = GatewayAuthConfig(api_keys=config.api_keys, open_paths=open_paths)
    install_bearer_auth(app, config)
    return engine, TestClient(app)


CHAT = {"model": "dsv4-flash", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": "Bearer "},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY},
    {"Authorization": f"Bearer {KEY[:-1]}"},
])
def test_missing_or_wrong_token_is_401_and_does_no_work(headers):
    engine, client = _client()
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
                               ("GET", "/openapi.json", None)):
        response = client.request(method, path, json=body, headers=headers)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert KEY not in response.text
    assert engine.submitted == [] and engine.admission_calls == []  # refused before any work


def test_right_token_is_served():
    _, client = _client()
    for key in (KEY, OTHER_KEY):
        models = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "dsv4-flash"
    chat = client.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"bearer {KEY}"})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "Hello there."


def test_only_health_stays_open_unless_configured():
    _, client = _client()
    assert client.get("/health").status_code == 200  # the scripted engine is healthy
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    _, scraped = _client(open_paths=("/health", "/metrics"))
    assert scraped.get("/metrics").status_code == 200
    _, closed = _client(open_paths=())
    assert closed.get("/health").status_code == 401
    assert closed.get("/metrics").status_code == 401
    assert closed.get("/health", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_openai_client_sees_authentication_error_then_succeeds():
    _, client = _client()
    wrong = openai.OpenAI(base_url="http://testserver/v1", api_key="not-the-key", http_client=client, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=client, max_retries=0)
    reply = right.chat.completions.create(model="dsv4-flash", messages=CHAT["messages"], max_tokens=8)
    assert reply.choices[0].message.content == "Hello there."


# ------------------------------------------------------------------ key loading


def test_api_keys_match_exactly():
    keys = ApiKeys.from_keys([KEY, OTHER_KEY, KEY])
    assert keys.num_keys == 2
    assert keys.matches(KEY) and keys.matches(OTHER_KEY)
    for token in (None, "", KEY + " ", KEY.upper(), KEY[:-1], OTHER_KEY + "0"):
        assert not keys.matches(token)
    assert KEY not in repr(keys)


def test_key_file_format_and_errors(tmp_path):
    path = tmp_path / "api_keys"
    path.write_text(f"# gateway keys\n\n  {KEY}  \n{OTHER_KEY}\n")
    path.chmod(0o600)
    assert read_api_key_file(path) == (KEY, OTHER_KEY)
    keys = load_api_keys(["extra-key-0123456789abcdef"], path)
    assert keys.matches(KEY) and keys.matches("extra-key-0123456789abcdef")
    assert load_api_keys() is None  # no keys configured: auth is off
    path.write_text("# only a comment\n")
    with pytest.raises(ApiKeyError, match="no API keys"):
        read_api_key_file(path)
    path.write_text("has a space\n")
    with pytest.raises(ApiKeyError, match=":1"):
        read_api_key_file(path)
    with pytest.raises(ApiKeyError, match="no such"):
        read_api_key_file(tmp_path / "absent")
    with pytest.raises(ApiKeyError):
        ApiKeys.from_keys([""])


def test_bearer_token_parsing():
    assert bearer_token(f"Bearer {KEY}") == KEY
    assert bearer_token(f"bearer   {KEY} ") == KEY
    assert bearer_token(None) is None
    assert bearer_token("Bearer") is None
    assert bearer_token(f"Token {KEY}") is None
