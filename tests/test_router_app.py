"""The gateway app through starlette's TestClient with a deterministic in-test engine."""

import json

import pytest
from router_support import ScriptedEngine, tiny_tokenizer
from starlette.testclient import TestClient

from moemesh.common.chat import tokens as tk
from moemesh.services.router.app import build_app
from moemesh.services.router.engine_client import Rejection
from moemesh.services.router.gateway_config import GatewayConfig

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)
ANSWER = "Héllo wörld 😀! The end."
D = tk.DSML


def ids(text):
    return TOKENIZER.encode(text, add_special_tokens=False).ids


def make(script_text=ANSWER, *, eos=True, **config_overrides):
    engine = ScriptedEngine(ids(script_text) + ([EOS] if eos else []), eos_id=EOS)
    fields = dict(model_name="dsv4-flash", max_model_len=256, eos_token_ids=(EOS,), keep_alive_interval_s=0.1)
    fields.update(config_overrides)
    client = TestClient(build_app(GatewayConfig(**fields), engine, TOKENIZER))
    return engine, client


def chat_body(**extra):
    return {"model": "dsv4-flash", "messages": [{"role": "user", "content": "Say hi"}], **extra}


def sse_events(client, path, body):
    """(data payloads, raw text) of one streamed request."""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    payloads = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]], raw


def test_chat_non_streaming_with_usage_and_prompt_encoding():
    engine, client = make()
    response = client.post("/v1/chat/completions", json=chat_body(max_tokens=100))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "dsv4-flash"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ANSWER}
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    num_prompt = len(engine.submitted[0].prompt_token_ids)
    assert usage["prompt_tokens"] == num_prompt
    assert usage["completion_tokens"] == len(ids(ANSWER)) + 1
    assert usage["total_tokens"] == num_prompt + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["speculative"] == {"ran": True, "draft_tokens": 4, "accepted_tokens": 3, "mean_accepted_length": 2.5}
    prompt = TOKENIZER.decode(list(engine.submitted[0].prompt_token_ids), skip_special_tokens=False)
    assert prompt == f"{tk.BOS}{tk.USER}Say hi{tk.ASSISTANT}</think>"
    params = engine.submitted[0].sampling_params
    assert params.max_tokens == 100 and EOS in params.stop_token_ids


def test_chat_thinking_splits_reasoning_and_content():
    engine, client = make("let me think</think>" + ANSWER)
    body = client.post("/v1/chat/completions", json=chat_body(chat_template_kwargs={"thinking": True})).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "let me think" and message["content"] == ANSWER
    prompt = TOKENIZER.decode(list(engine.submitted[0].prompt_token_ids), skip_special_tokens=False)
    assert prompt.endswith(f"{tk.ASSISTANT}<think>")


def test_chat_streaming_equals_non_streaming():
    _, client = make("let me think</think>" + ANSWER)
    body = chat_body(thinking={"type": "enabled"}, stream=True, stream_options={"include_usage": True})
    chunks, _ = sse_events(client, "/v1/chat/completions", body)
    choice_chunks = [c for c in chunks if c["choices"]]
    assert choice_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in choice_chunks)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in choice_chunks)
    assert (content, reasoning) == (ANSWER, "let me think")
    assert choice_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_n_fans_out_with_derived_seeds():
    engine, client = make()
    body = client.post("/v1/chat/completions", json=chat_body(n=3, seed=7, temperature=0.8)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    seeds = [r.sampling_params.seed for r in engine.submitted]
    assert seeds[0] == 7 and len(set(seeds)) == 3
    assert len({r.request_id for r in engine.submitted}) == 3
    assert body["usage"]["prompt_tokens"] == len(engine.submitted[0].prompt_token_ids)
    assert body["usage"]["completion_tokens"] == sum(len(engine.tokens_for(r)) for r in engine.submitted)


def test_streaming_n_choices_each_finish_once():
    _, client = make()
    chunks, _ = sse_events(client, "/v1/completions", {"prompt": "hi", "n": 2, "stream": True, "seed": 1})
    texts = {0: "", 1: ""}
    finishes = []
    for chunk in chunks:
        choice = chunk["choices"][0]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes.append(choice["index"])
    assert sorted(finishes) == [0, 1]
    assert texts[0] != texts[1]  # different seeds -> different scripted outputs


def test_chat_logprobs():
    _, client = make()
    body = client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2, max_tokens=3)).json()
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3 and body["choices"][0]["finish_reason"] == "length"
    first_id = ids(ANSWER)[0]
    assert entries[0]["token"] == TOKENIZER.decode([first_id])
    assert entries[0]["logprob"] == -0.5 and len(entries[0]["top_logprobs"]) == 2
    assert bytes(entries[0]["bytes"]).decode() == entries[0]["token"]


def test_completion_logprobs_and_token_id_prompts():
    engine, client = make()
    response = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "logprobs": 1, "max_tokens": 4})
    body = response.json()
    assert response.status_code == 200 and body["object"] == "text_completion"
    assert [tuple(r.prompt_token_ids) for r in engine.submitted] == [(5, 6, 7), (8, 9)]
    assert body["usage"]["prompt_tokens"] == 5
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 4 and logprobs["text_offset"][0] == 0
    assert "".join(logprobs["tokens"]) == body["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_aborts(stream):
    engine, client = make()
    body = {"prompt": "hi", "stop": ["wörld", "zzz"], "stream": stream, "max_tokens": 50}
    if stream:
        chunks, _ = sse_events(client, "/v1/completions", body)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    assert text == "Héllo " and finish == "stop"
    assert engine.aborted == [engine.submitted[0].request_id]


def test_keep_alive_comments_during_a_long_prefill():
    engine, client = make()
    engine.first_token_delay_s = 0.45
    _, raw = sse_events(client, "/v1/chat/completions", chat_body(stream=True))
    assert raw.count(": keep-alive\n\n") >= 2
    assert raw.index(": keep-alive") < raw.index('"content"')


def test_tool_calls_come_back_in_openai_shape():
    script = (f"Checking.\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
              f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
    engine, client = make(script, max_model_len=2048)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = client.post("/v1/chat/completions", json=chat_body(tools=tools)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"} and call["id"].startswith("call_")
    prompt = TOKENIZER.decode(list(engine.submitted[0].prompt_token_ids), skip_special_tokens=False)
    assert "## Tools" in prompt and '"get_weather"' in prompt


BAD_BODIES = [
    ("messages", {"messages": []}),
    ("messages", {"messages": "hi"}),
    ("messages", {"messages": None}),
    ("messages[0].role", {"messages": [{"role": "bot", "content": "x"}]}),
    ("max_tokens", {"max_tokens": -1}),
    ("max_tokens", {"max_tokens": 10**9}),
    ("max_tokens", {"max_tokens": "5"}),
    ("max_tokens", {"max_tokens": 250}),  # prompt + 250 > max_model_len 256
    ("temperature", {"temperature": "hot"}),
    ("temperature", {"temperature": 3.5}),
    ("top_p", {"top_p": 0}),
    ("n", {"n": 0}),
    ("n", {"n": 1000}),
    ("stop", {"stop": [1, 2]}),
    ("stop", {"stop": [""]}),
    ("stream", {"stream": "yes"}),
    ("top_logprobs", {"top_logprobs": 3}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 50}),
    ("seed", {"seed": 1.5}),
    ("tools[0]", {"tools": [{"type": "function"}]}),
    ("tool_choice", {"tool_choice": "always"}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    ("messages", {"messages": [{"role": "user", "content": "x" * 2000}]}),  # longer than the context
]


@pytest.mark.parametrize("param,override", BAD_BODIES)
def test_bad_chat_input_is_a_400_with_openai_error_body(param, override):
    engine, client = make()
    response = client.post("/v1/chat/completions", json={**chat_body(), **override})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"].startswith(param.split("[")[0])
    assert engine.submitted == []


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"[1, 2]", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}'],
)
def test_malformed_json_and_invalid_utf8_are_400(raw):
    _, client = make()
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", ["", [], [[]], [1.5], [-1], [10**7], {"a": 1}])
def test_bad_completion_prompts_are_400(prompt):
    _, client = make()
    response = client.post("/v1/completions", json={"prompt": prompt})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_unknown_fields_are_ignored():
    _, client = make()
    response = client.post("/v1/chat/completions", json=chat_body(frobnicate=True, logit_bias={"1": 2}))
    assert response.status_code == 200


def test_unknown_model_is_404():
    engine, client = make()
    response = client.post("/v1/chat/completions", json=chat_body(model="gpt-9"))
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/nothing").status_code == 404


def test_overload_is_429_with_retry_after_before_tokenizing():
    engine, client = make()
    engine.rejection = Rejection("queue full", retry_after_s=2.2)
    response = client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert engine.admission_calls and engine.submitted == []


def test_engine_error_is_503_non_streaming():
    engine, client = make()
    engine.fail = True
    response = client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 503 and "down" in response.json()["error"]["message"]
    assert response.headers["retry-after"] == "5"
    engine.fail, engine.fail_in_stream = False, True
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 503


def test_engine_error_mid_stream_is_finish_reason_error():
    engine, client = make()
    engine.fail_in_stream = True
    chunks, _ = sse_events(client, "/v1/chat/completions", chat_body(stream=True))
    finished = [chunk for chunk in chunks if chunk.get("choices") and chunk["choices"][0].get("finish_reason")]
    assert finished[-1]["choices"][0]["finish_reason"] == "error"
    assert chunks[-1]["error"]["message"] == "expert worker lost"  # what ended it, then [DONE]


def test_deadline_aborts_and_answers_504():
    engine, client = make(request_timeout_s=0.2)
    engine.step_delay_s = 0.1
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40})
    assert response.status_code == 504
    assert engine.aborted == [engine.submitted[0].request_id]


def test_models_health_metrics_openapi():
    engine, client = make()
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "dsv4-flash" and models["data"][0]["max_model_len"] == 256
    assert client.get("/health").status_code == 200
    engine.healthy = False
    health = client.get("/health")
    assert health.status_code == 503 and "down" in health.json()["services"]["expert-0"]
    client.post("/v1/chat/completions", json=chat_body())
    client.post("/v1/chat/completions", json=chat_body(n=0))
    text = client.get("/metrics").text
    assert 'moemesh_requests_total{endpoint="chat",outcome="ok"} 1.0' in text
    assert 'moemesh_requests_total{endpoint="chat",outcome="bad_request"} 1.0' in text
    assert "moemesh_time_to_first_token_seconds_count 1.0" in text
    assert f"moemesh_generation_tokens_total {len(ids(ANSWER)) + 1}.0" in text
    assert 'moemesh_kv_blocks_used{tier="gpu"} 10.0' in text and "moemesh_queue_depth 2.0" in text
    assert 'moemesh_spec_acceptance_rate{position="1"} 0.625' in text
    assert "moemesh_spec_accepted_tokens_total 3.0" in text
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.add(node["$ref"].rsplit("/", 1)[-1])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert refs and refs <= set(doc["components"]["schemas"])
    chat_props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "tools", "top_logprobs", "stream_options"} <= set(chat_props)


def test_two_apps_have_separate_metric_registries():
    _, first = make()
    _, second = make()
    first.post("/v1/completions", json={"prompt": "hi"})
    assert 'outcome="ok"} 1.0' in first.get("/metrics").text
    assert 'outcome="ok"}' not in second.get("/metrics").text


def test_streamed_tool_calls_and_finish_reason():
    script = (f"<{D}tool_calls>\n<{D}invoke name=\"now\">\n</{D}invoke>\n</{D}tool_calls>")
    _, client = make(script, max_model_len=2048)
    tools = [{"type": "function", "function": {"name": "now"}}]
    chunks, _ = sse_events(client, "/v1/chat/completions", chat_body(tools=tools, stream=True))
    calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [(0, "now", "{}")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ""
