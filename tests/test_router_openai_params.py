"""Every OpenAI parameter is implemented or refused with a 400 naming it; tool definitions are
JSON Schemas; errors name the field the client sent."""

from __future__ import annotations

import json

import pytest
from router_support import ScriptedEngine, tiny_tokenizer
from starlette.testclient import TestClient

from moemesh.common.chat import tokens as tk
from moemesh.services.router.app import build_app
from moemesh.services.router.gateway_config import GatewayConfig

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)
ANSWER = "Hello world"


def make(**config):
    engine = ScriptedEngine(TOKENIZER.encode(ANSWER, add_special_tokens=False).ids + [EOS], eos_id=EOS)
    fields = dict(model_name="m", max_model_len=2048, eos_token_ids=(EOS,), keep_alive_interval_s=0.1, **config)
    return engine, TestClient(build_app(GatewayConfig(**fields), engine, TOKENIZER))


ENGINE, CLIENT = make()
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def error_of(response, status=400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"suffix": "the end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"best_of": 2, "n": 3}, "best_of"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"parallel_tool_calls": False, "tools": [WEATHER]}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"service_tier": "priority"}, "service_tier"),
])
def test_unsupported_parameters_are_refused_by_name(path, extra, param):
    body = {**CHAT, **extra} if "chat" in path else {"prompt": "Say hi", "max_tokens": 4, **extra}
    num_submitted = len(ENGINE.submitted)
    error = error_of(CLIENT.post(path, json=body))
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert len(ENGINE.submitted) == num_submitted


@pytest.mark.parametrize("extra", [
    {"best_of": 1}, {"best_of": 2, "n": 2}, {"suffix": ""}, {"suffix": None}, {"echo": False},
])
def test_completion_values_that_ask_for_nothing_unsupported_are_served(extra):
    assert CLIENT.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 4, **extra}).status_code == 200


@pytest.mark.parametrize("extra", [
    {"parallel_tool_calls": True, "tools": [WEATHER]}, {"modalities": ["text"]}, {"store": False},
    {"service_tier": "auto"}, {"metadata": {"team": "a"}}, {"user": "u-1"},
])
def test_chat_values_that_ask_for_nothing_unsupported_are_served(extra):
    assert CLIENT.post("/v1/chat/completions", json={**CHAT, **extra}).status_code == 200


def test_echo_puts_the_prompt_before_each_choice():
    body = {"prompt": ["Say hi", "Bye"], "max_tokens": 4, "echo": True, "n": 2, "temperature": 0}
    choices = CLIENT.post("/v1/completions", json=body).json()["choices"]
    generated = CLIENT.post("/v1/completions", json={**body, "echo": False}).json()["choices"]
    assert [c["text"] for c in choices] == [p + g["text"] for p, g in zip(["Say hi", "Say hi", "Bye", "Bye"], generated)]
    assert generated[0]["text"] and not generated[0]["text"].startswith("Say hi")
    ids = TOKENIZER.encode("Say hi", add_special_tokens=False).ids
    plain = CLIENT.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "echo": True}).json()
    assert plain["choices"][0]["text"].startswith("Say hi")  # token ids: their text
    with CLIENT.stream("POST", "/v1/completions", json={"prompt": "Say hi", "max_tokens": 4, "echo": True,
                                                       "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    texts = [json.loads(line)["choices"][0]["text"] for line in lines[:-1]]
    assert texts[0] == "Say hi" and "".join(texts) == "Say hi" + plain["choices"][0]["text"][6:]
    assert lines[-1] == "[DONE]"


@pytest.mark.parametrize(("parameters", "message"), [
    ("not-a-schema", "must be a JSON Schema"),
    ({"type": "objekt"}, "not a valid JSON Schema"),
    ({"type": "object", "properties": {"city": {"type": 5}}}, "not a valid JSON Schema"),
    ({"type": "object", "required": "city"}, "not a valid JSON Schema"),
])
def test_tools_with_invalid_schemas_are_refused(parameters, message):
    tool = {"type": "function", "function": {"name": "weather", "parameters": parameters}}
    error = error_of(CLIENT.post("/v1/chat/completions", json={**CHAT, "tools": [tool]}))
    assert error["param"] == "tools[0].function.parameters" and message in error["message"], error


def test_tool_names_and_tool_choice_are_checked():
    assert CLIENT.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER]}).status_code == 200
    named = {"type": "function", "function": {"name": "weather"}}
    assert CLIENT.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER], "tool_choice": "auto"}).status_code == 200
    # forcing a call (a named function, "required") is refused, not ignored
    for forced in (named, "required"):
        error = error_of(CLIENT.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER], "tool_choice": forced}))
        assert error["param"] == "tool_choice" and error["code"] == "unsupported_parameter", error
    unknown = {"type": "function", "function": {"name": "stocks"}}
    error = error_of(CLIENT.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER], "tool_choice": unknown}))
    assert error["param"] == "tool_choice" and "stocks" in error["message"]
    assert error_of(CLIENT.post("/v1/chat/completions", json={**CHAT, "tool_choice": named}))["param"] == "tool_choice"
    assert error_of(CLIENT.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"}))["param"] == "tool_choice"
    twice = error_of(CLIENT.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER, WEATHER]}))
    assert twice["param"] == "tools[1].function.name"
    bad_name = {"type": "function", "function": {"name": "no spaces allowed"}}
    assert error_of(CLIENT.post("/v1/chat/completions", json={**CHAT, "tools": [bad_name]}))["param"] == \
        "tools[0].function.name"


def test_too_many_prompts_in_one_request_are_refused():
    error = error_of(CLIENT.post("/v1/completions", json={"prompt": ["hi"] * 257, "max_tokens": 1}))
    assert error["param"] == "prompt" and "at most 256" in error["message"]


def test_context_errors_name_the_field_the_client_sent():
    long_ids = list(range(10, 80)) * 30  # 2,100 tokens, context 2,048
    error = error_of(CLIENT.post("/v1/completions", json={"prompt": long_ids}))
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    long_text = "Hello world, this is a tiny corpus for a tiny tokenizer. " * 200
    assert error_of(CLIENT.post("/v1/completions", json={"prompt": long_text}))["param"] == "prompt"
    assert error_of(CLIENT.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": long_text}]}))["param"] == "messages"
    assert error_of(CLIENT.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 2040}))["param"] == \
        "max_completion_tokens"
    assert error_of(CLIENT.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2040}))["param"] == "max_tokens"
    assert error_of(CLIENT.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2048}))["param"] == "max_tokens"
