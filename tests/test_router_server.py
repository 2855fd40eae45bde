"""The gateway on a real uvicorn server (uvloop) on localhost: the `openai` package as the
client, and client disconnects that must abort the engine sequences."""

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from router_support import ScriptedEngine, tiny_tokenizer

from moemesh.common.chat import tokens as tk
from moemesh.services.router.app import build_app
from moemesh.services.router.gateway_config import GatewayConfig

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)
ANSWER = "Héllo wörld 😀! The quick brown fox."
MODEL = "dsv4-flash"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    script = TOKENIZER.encode("mull it over</think>" + ANSWER, add_special_tokens=False).ids + [EOS]
    engine = ScriptedEngine(script, eos_id=EOS)
    config = GatewayConfig(MODEL, max_model_len=4096, eos_token_ids=(EOS,), keep_alive_interval_s=0.2)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(config, engine, TOKENIZER), host="127.0.0.1", port=port,
                                       loop="uvloop", log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield engine, f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def engine(server):
    engine, _ = server
    engine.step_delay_s = engine.first_token_delay_s = 0.0
    engine.submitted.clear()
    engine.aborted.clear()
    return engine


@pytest.fixture
def client(server):
    _, base_url = server
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=20)


def test_openai_chat_non_streaming(engine, client):
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}],
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    message = completion.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == "mull it over"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens == len(engine.submitted[0].prompt_token_ids)
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


def test_openai_chat_streaming(engine, client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], stream=True,
        stream_options={"include_usage": True}, extra_body={"thinking": True},
    )
    content, reasoning, finish, usage = "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            finish = choice.finish_reason or finish
    assert (content, reasoning, finish) == (ANSWER, "mull it over", "stop")
    assert usage is not None and usage.completion_tokens == len(engine.tokens_for(engine.submitted[0]))


def test_openai_completions(engine, client):
    completion = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, n=2, seed=3)
    assert len(completion.choices) == 2
    assert all(c.finish_reason == "length" for c in completion.choices)
    assert completion.usage.completion_tokens == 12
    streamed = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=200, stream=True)
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    # completions skip special tokens, and the test tokenizer marks </think> special
    assert text == "mull it over" + ANSWER


def test_openai_errors_surface_as_exceptions(engine, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=5)
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_stream_disconnect_aborts(server, engine):
    _, base_url = server
    engine.step_delay_s = 0.05
    body = {"model": MODEL, "prompt": "go", "max_tokens": 200, "stream": True, "n": 2}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # got the first token, now walk away
    submitted = {r.request_id for r in engine.submitted}
    assert len(submitted) == 2
    assert wait_for(lambda: set(engine.aborted) >= submitted), engine.aborted


def test_non_streaming_disconnect_aborts(server, engine):
    _, base_url = server
    engine.first_token_delay_s = 3.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "go"}, timeout=0.5)
    assert wait_for(lambda: engine.submitted and engine.aborted == [engine.submitted[0].request_id])
