"""`ignore_eos` through the gateway: EOS must not reach the engine as a stop token (the
scheduler checks stop ids before it looks at ignore_eos, so it would end the request at the
first EOS anyway), and chat, which keeps special tokens for its parser, shows the text generated
past an ignored EOS without the EOS / BOS markers themselves.

The gateway is the real app over router_support's scripted engine; the stop decision is the
real scheduler's (`append_sampled_tokens`) applied to the parameters the gateway submitted.
"""

from __future__ import annotations

from router_support import ScriptedEngine, tiny_tokenizer
from starlette.testclient import TestClient

from moemesh.common.chat import tokens as tk
from moemesh.services.router.app import build_app
from moemesh.services.router.gateway_config import GatewayConfig
from moemesh.services.router.scheduler.request import Request
from moemesh.services.router.scheduler.stop_checks import append_sampled_tokens

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)
BOS = TOKENIZER.token_to_id(tk.BOS)


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False).ids


def _client(script: list[int]) -> tuple[ScriptedEngine, TestClient]:
    engine = ScriptedEngine(script, eos_id=EOS)
    config = GatewayConfig(model_name="dsv4-flash", max_model_len=256, eos_token_ids=(EOS,))
    return engine, TestClient(build_app(config, engine, TOKENIZER))


def _stops_at_eos(submitted) -> bool:
    """Whether the scheduler ends this submitted request at an EOS token."""
    request = Request(request_id="r", prompt_token_ids=(5, 6), sampling_params=submitted.sampling_params,
                      arrival_time_s=0.0, eos_token_ids=(EOS,))
    _, finish_reason = append_sampled_tokens(request, [EOS], max_model_len=256)
    return finish_reason is not None


def test_ignore_eos_is_not_overridden_by_eos_as_a_stop_token():
    engine, client = _client(ids("a b c") + [EOS])
    body = {"model": "dsv4-flash", "prompt": "x", "max_tokens": 8}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={**body, "ignore_eos": True}).status_code == 200
    honoured, ignored = engine.submitted
    assert _stops_at_eos(honoured)
    assert ignored.sampling_params.ignore_eos and not _stops_at_eos(ignored)


def test_chat_shows_text_past_an_ignored_eos_without_the_markers():
    before, after = "Jesus wept.", " Psalms 119:1 Blessed are"
    _, client = _client(ids(before) + [EOS, BOS] + ids(after))
    body = {"model": "dsv4-flash", "messages": [{"role": "user", "content": "Recite John 11:35"}], "max_tokens": 64}
    stopped = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert stopped["message"]["content"] == before and stopped["finish_reason"] == "stop"
    ignored = client.post("/v1/chat/completions", json={**body, "ignore_eos": True}).json()["choices"][0]
    assert ignored["message"]["content"] == before + after
    assert ignored["finish_reason"] == "length"
