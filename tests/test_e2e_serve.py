"""End to end: `moemesh serve` with router, attention worker and two expert workers as real
processes on a tiny random checkpoint (KJV tokenizer, fp32 CPU), the `openai` package as client.

Every generated token is compared with the single-process reference model
(`common.model.generate.generate_batch`, greedy), and text completions also with transformers
(its tokenizer adds BOS to a text prompt, as the checkpoint's tokenizer says). The services
start once for the module; the last test stops `serve` with SIGTERM while streams are open:
the short one finishes, the long one is cut at the drain timeout with an error event and
`[DONE]`, new requests get 503, and every child process is gone afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "models" / "kjv-dsv4-mini"
MODEL_NAME = "kjv-tiny"
EOS_ID = 1
DRAIN_TIMEOUT_S = 6

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").exists(), reason="KJV tokenizer missing"),
]


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from moemesh.common.checkpoint.writer import write_checkpoint
    from tiny_checkpoint_support import random_hub_state_dict, tiny_config
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = tiny_config(vocab_size=vocab_size, eos_token_id=EOS_ID)
    state = random_hub_state_dict(config, seed=1234)
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL_NAME, config, state, tokenizer_dir=TOKENIZER_DIR)


class Reference:
    """Greedy outputs of the single-process reference model, one prompt at a time, cached."""

    def __init__(self, path: Path) -> None:
        from moemesh.commands.generate import _load_model
        from tokenizers import Tokenizer

        from moemesh.services.router.detokenizer import TokenBytes

        self.model, self.config = _load_model(str(path), "float32", "cpu")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.token_bytes = TokenBytes(self.tokenizer)
        self._cache: dict[tuple, list[int]] = {}

    def generate(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        from moemesh.common.model.generate import GenerationConfig, generate_batch

        key = (tuple(prompt_ids), max_tokens)
        if key not in self._cache:
            config = GenerationConfig(max_new_tokens=max_tokens, stop_token_ids=(EOS_ID,))
            self._cache[key] = generate_batch(self.model, [prompt_ids], config)[0]
        return self._cache[key]

    def encode(self, text: str) -> list[int]:
        """A completion prompt as the model sees it: with the tokenizer's special tokens (BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def encode_chat(self, prompt: str) -> list[int]:
        """An encoded chat prompt: it carries its own BOS."""
        return self.tokenizer.encode(prompt, add_special_tokens=False).ids

    def completion_text(self, token_ids: list[int]) -> str:
        """What the gateway's completions endpoint shows for these tokens."""
        from moemesh.services.router.detokenizer import IncrementalDetokenizer

        detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True, token_bytes=self.token_bytes)
        return detokenizer.add(token_ids) + detokenizer.finish()

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.token_bytes(t).decode("utf-8", errors="replace") for t in token_ids]


@pytest.fixture(scope="module")
def reference(checkpoint) -> Reference:
    return Reference(checkpoint)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen
    child_pids: list[int]
    log_dir: Path
    stdout_lines: "queue.Queue[str]"

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        match = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", text, re.MULTILINE)
        assert match is not None, f"{name}{labels} not in /metrics"
        return float(match.group(1))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    port = _free_port()
    run_dir = tmp_path_factory.mktemp("run")
    command = [sys.executable, "-m", "moemesh.cli", "serve", "--model", str(checkpoint), "--port", str(port),
               "--expert-workers", "2", "--devices", "cpu", "--run-dir", str(run_dir), "--ready-timeout", "240",
               "--drain-timeout", str(DRAIN_TIMEOUT_S)]
    stderr = open(run_dir / "serve.stderr", "wb")
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    first, deadline = "", time.monotonic() + 300
    while not first and process.poll() is None and time.monotonic() < deadline:
        try:
            first = lines.get(timeout=0.5)
        except queue.Empty:
            pass
    if "moemesh serving" not in first:
        process.kill()
        process.wait()
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.stderr")))
        pytest.fail(f"serve did not become ready: {first!r}\n{(run_dir / 'serve.stderr').read_text()[-3000:]}\n{logs}")
    server = Server(f"http://127.0.0.1:{port}", process, _children_of(process.pid), run_dir / "logs", lines)
    yield server
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    for pid in server.child_pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    stderr.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


PROMPTS = [
    "In the beginning",
    "And God said, Let there be light: and there was light. And God saw the light, that it was good.",
    " ".join(["And the earth was without form, and void; and darkness was upon the face of the deep."] * 4),
    " ".join(["The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures."] * 8),
]


# ------------------------------------------------------------------ tests
def test_services_report_healthy(server, client):
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200
    services = health.json()["services"]
    assert services == {"attention-0": "ok", "expert-0": "ok", "expert-1": "ok"}
    assert MODEL_NAME in [model.id for model in client.models.list().data]


def test_concurrent_completions_streaming_and_not_match_reference(async_client, reference):
    max_tokens = [12, 9, 7, 10]
    prompt_ids = [reference.encode(prompt) for prompt in PROMPTS]
    assert len(prompt_ids[-1]) > 128  # crosses the HCA window and a KV block boundary
    expected = [reference.generate(ids, n) for ids, n in zip(prompt_ids, max_tokens)]

    async def one(prompt: str, n: int, stream: bool) -> tuple[str, str | None]:
        if not stream:
            answer = await async_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n,
                                                           temperature=0)
            return answer.choices[0].text, answer.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await async_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n,
                                                                 temperature=0, stream=True):
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
        return text, finish

    async def all_at_once():
        jobs = [one(p, n, stream=index % 2 == 1) for index, (p, n) in enumerate(zip(PROMPTS, max_tokens))]
        jobs += [one(p, n, stream=index % 2 == 0) for index, (p, n) in enumerate(zip(PROMPTS, max_tokens))]
        return await asyncio.gather(*jobs)

    answers = asyncio.run(all_at_once())
    for index, (text, finish) in enumerate(answers):
        tokens = expected[index % len(PROMPTS)]
        assert text == reference.completion_text(tokens), f"prompt {index % len(PROMPTS)}"
        assert finish == ("stop" if tokens[-1] == EOS_ID else "length")


def test_text_completions_equal_transformers_greedy(client, checkpoint, reference):
    """The hub-format checkpoint's tokenizer adds BOS (tokenizer_config.json: add_bos_token): a
    text prompt gets it through the server as through transformers, so the greedy tokens and the
    prompt token count are transformers' own."""
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    import torch
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM, FineGrainedFP8Config

    hf_tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = DeepseekV4ForCausalLM.from_pretrained(checkpoint, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                  attn_implementation="eager").float().eval()
    max_tokens = 5
    for prompt in PROMPTS[:2]:
        prompt_ids = hf_tokenizer(prompt).input_ids
        assert prompt_ids[0] == hf_tokenizer.bos_token_id
        tokens = list(prompt_ids)
        with torch.no_grad():
            while len(tokens) - len(prompt_ids) < max_tokens and tokens[-1] != EOS_ID:
                tokens.append(int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
        expected = tokens[len(prompt_ids):]
        answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           logprobs=0)
        assert answer.usage.prompt_tokens == len(prompt_ids), prompt
        assert answer.choices[0].logprobs.tokens == reference.token_strings(expected), prompt
        assert answer.choices[0].text == reference.completion_text(expected)


def test_completion_logprobs_are_the_reference_tokens(client, reference):
    prompt = PROMPTS[1]
    tokens = reference.generate(reference.encode(prompt), 8)
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == reference.token_strings(tokens)
    assert all(value <= 0.0 for value in logprobs.token_logprobs)
    for chosen, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) >= 1 and max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: chosen is the top
    assert answer.usage.completion_tokens == len(tokens)


def _transformers_greedy(checkpoint: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' DeepseekV4ForCausalLM on the checkpoint's (dequantised) weights, greedy, no cache."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.model.names import hub_to_hf_state_dict

    reader = CheckpointReader(checkpoint)
    hf_config = DeepseekV4Config(**reader.config.to_transformers_dict())
    hf_config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(hf_config).float().eval()
    model.load_state_dict(hub_to_hf_state_dict(reader.load_all(torch.float32), reader.config))
    tokens = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            next_id = int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax())
            tokens.append(next_id)
            if next_id == EOS_ID:
                break
    return tokens[len(prompt_ids):]


def test_greedy_output_equals_transformers_on_the_quantized_checkpoint(client, checkpoint, reference):
    """The served path (FP8 linears kept FP8, FP4 experts in two workers' stacks) against transformers."""
    prompt = PROMPTS[0]
    expected = _transformers_greedy(checkpoint, reference.encode(prompt), 8)
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    assert answer.choices[0].logprobs.tokens == reference.token_strings(expected)


def test_each_worker_reports_weight_bytes_within_the_goal_of_its_stored_bytes(server, checkpoint):
    status = httpx.get(f"{server.base_url}/status.json", timeout=10).json()
    weights = {record["name"]: record for record in status["weights"]}
    assert {"attention-0", "expert-0", "expert-1"} <= set(weights)
    for name in ("attention-0", "expert-0", "expert-1"):
        record = weights[name]
        assert record["stored_bytes"] > 0 and record["device"] == "cpu"
        assert record["resident_bytes"] <= 1.05 * record["stored_bytes"], record
        for kind in ("resident", "stored"):
            gauge = server.metric("moemesh_worker_weight_bytes",
                                  f'{{device="cpu",kind="{kind}",worker="{name}"}}')  # labels sorted
            assert gauge == record[f"{kind}_bytes"]
    # the two expert workers split the routed experts: together they hold each one once
    from moemesh.common.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(checkpoint)
    routed = sum(reader.stored_nbytes(entry.name) for spec in reader.inventory.values() if spec.is_routed_expert
                 for entry in spec.stored_entries())
    assert weights["expert-0"]["stored_bytes"] + weights["expert-1"]["stored_bytes"] == routed


def test_chat_streaming_and_not_match_reference(client, reference):
    from moemesh.common.chat.encoding import encode_messages

    messages = [{"role": "user", "content": "Who made the heaven and the earth?"}]
    tokens = reference.generate(reference.encode_chat(encode_messages(messages)), 10)
    expected_bytes = [list(reference.token_bytes(t)) for t in tokens]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=1)
    assert [entry.bytes for entry in answer.choices[0].logprobs.content] == expected_bytes
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                                logprobs=True, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed += [entry.bytes for entry in choice.logprobs.content]
    assert streamed == expected_bytes


def test_n_choices_and_stop_string(client, reference):
    prompt = PROMPTS[0]
    tokens = reference.generate(reference.encode(prompt), 16)
    full_text = reference.completion_text(tokens)
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, n=3)
    assert sorted(choice.index for choice in answer.choices) == [0, 1, 2]
    assert all(choice.text == full_text for choice in answer.choices)  # greedy: every choice is the reference
    stop = next(full_text[i:i + 2] for i in range(len(full_text) // 2, len(full_text) - 1)
                if full_text[i:i + 2].strip() and full_text[i:i + 2] not in full_text[:i])
    cut = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full_text[: full_text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_abort_on_disconnect_frees_all_blocks(server):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[3], "max_tokens": 600, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            assert server.metric("moemesh_kv_blocks_used", '{tier="gpu"}') > 0
            assert server.metric("moemesh_running_sequences") == 1
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if server.metric("moemesh_kv_blocks_used", '{tier="gpu"}') == 0:
            break
        time.sleep(0.1)
    assert server.metric("moemesh_kv_blocks_used", '{tier="gpu"}') == 0
    assert server.metric("moemesh_running_sequences") == 0
    assert server.metric("moemesh_queue_depth") == 0


def test_second_request_sharing_a_long_prefix_gets_the_same_output(client, server, reference):
    prefix = " ".join([PROMPTS[3], PROMPTS[2], PROMPTS[3]])
    first_prompt, second_prompt = prefix + " And he said", prefix + " Then came"
    assert len(reference.encode(prefix)) > 3 * 128  # more than two full KV blocks shared
    hits_before = server.metric("moemesh_prefix_cache_hit_tokens_total")
    cached = []
    for prompt in (first_prompt, second_prompt, first_prompt):
        tokens = reference.generate(reference.encode(prompt), 6)
        answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
        assert answer.choices[0].text == reference.completion_text(tokens)
        details = answer.usage.prompt_tokens_details
        cached.append(0 if details is None else details.cached_tokens)
    assert cached[1] >= 2 * 128 and cached[2] >= 2 * 128 and cached[1] > cached[0]  # restored from the cache
    assert server.metric("moemesh_prefix_cache_hit_tokens_total") - hits_before >= cached[1] + cached[2]


def test_abort_after_a_prefix_hit_frees_all_blocks(server, reference):
    prefix = " ".join([PROMPTS[3], PROMPTS[2], PROMPTS[3]])
    body = {"model": MODEL_NAME, "prompt": prefix + " And he said", "max_tokens": 600, "temperature": 0,
            "stream": True}
    hits_before = server.metric("moemesh_prefix_cache_hit_tokens_total")
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            assert server.metric("moemesh_kv_blocks_used", '{tier="gpu"}') > 0
    assert server.metric("moemesh_prefix_cache_hit_tokens_total") > hits_before
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and server.metric("moemesh_kv_blocks_used", '{tier="gpu"}') != 0:
        time.sleep(0.1)
    assert server.metric("moemesh_kv_blocks_used", '{tier="gpu"}') == 0
    assert server.metric("moemesh_kv_blocks_used", '{tier="cpu"}') == 0
    assert server.metric("moemesh_running_sequences") == 0
    # no request holds a resume snapshot any more; the prefix cache keeps some (where the hit above resumed)
    assert server.metric("moemesh_kv_snapshots_used", '{tier="gpu"}') == 0
    assert server.metric("moemesh_kv_snapshots_cached", '{tier="gpu"}') > 0


@pytest.mark.slow  # ~100 s on 2 cores: its own router, attention and expert processes
def test_tiny_primary_pool_preempts_by_swap_and_returns_reference_outputs(checkpoint, reference, tmp_path):
    """Router, attention worker and one expert worker from a deployment whose [kv] table gives a
    primary pool too small for the requests at once: sequences are swapped to the CPU tier and
    restored from it (PrefixRestore at a block boundary), and every output is still the reference."""
    from moemesh.commands.serve_config import ServeLayout, deployment_table
    from moemesh.common.runtime.deployment_writer import write_deployment_file
    from moemesh.common.runtime.launcher import start_service, stop_services

    port = _free_port()
    table = deployment_table(ServeLayout(model_path=str(checkpoint), run_dir=str(tmp_path), log_dir=str(tmp_path / "logs"),
                                         port=port))
    table["kv"] = {"block_size_tokens": 128, "num_primary_blocks": 7, "num_cpu_blocks": 16, "prefix_caching": True}
    config_path = tmp_path / "deployment.toml"
    write_deployment_file(config_path, table)
    services = [start_service(role, name, config_path, tmp_path / "logs")
                for role, name in (("router", "router"), ("attention", "attention-0"), ("expert", "expert-0"))]
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert all(service.exit_code is None for service in services), "a service died at start-up"
            time.sleep(0.5)
        prompts = [" ".join([PROMPTS[2], PROMPTS[3], PROMPTS[2], PROMPTS[1], text])
                   for text in ("And he said", "Then came", "Now")]
        prompt_ids = [reference.encode(prompt) for prompt in prompts]
        assert all(3 * 128 - 16 > len(ids) > 2 * 128 + 40 for ids in prompt_ids)  # 3 blocks each, 7 in the pool
        max_tokens = 3 * 128 + 8 - min(len(ids) for ids in prompt_ids)  # every sequence grows into a 4th block
        expected = [reference.generate(ids, max_tokens) for ids in prompt_ids]
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        async def all_at_once():
            jobs = [client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
                    for prompt in prompts]
            return await asyncio.gather(*jobs)

        answers = asyncio.run(all_at_once())
        for index, answer in enumerate(answers):
            assert answer.choices[0].text == reference.completion_text(expected[index]), f"prompt {index}"
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        assert re.search(r'^moemesh_kv_blocks_used\{tier="gpu"\} 0(\.0)?$', text, re.MULTILINE), text[-2000:]
        assert re.search(r'^moemesh_kv_blocks_used\{tier="cpu"\} 0(\.0)?$', text, re.MULTILINE)
        swaps = re.search(r'^moemesh_preemptions_total\{mode="swap"\} ([0-9.e+-]+)$', text, re.MULTILINE)
        assert swaps and float(swaps.group(1)) >= 1, "no sequence was swapped to the CPU tier"
    finally:
        stop_services(services, 20)


def test_health_answers_within_a_second_while_a_20_mib_prompt_is_refused(server):
    words = "And God said, Let there be light: and there was light. "
    body = json.dumps({"model": MODEL_NAME, "prompt": words * (20 * 2**20 // len(words))}).encode()
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(httpx.post(
        f"{server.base_url}/v1/completions", content=body, headers={"content-type": "application/json"},
        timeout=120)), daemon=True)
    latencies = []
    sender.start()
    with httpx.Client(timeout=30) as http:
        while sender.is_alive() or not latencies:
            start = time.monotonic()
            assert http.get(f"{server.base_url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    sender.join()
    assert answer[0].status_code == 400 and answer[0].json()["error"]["param"] == "prompt"
    assert answer[0].json()["error"]["code"] == "context_length_exceeded"
    assert max(latencies) < 1.0, sorted(latencies)[-3:]


def _stream_lines(base_url: str, body: dict, first_data: threading.Event, lines: list[str]) -> None:
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
                    first_data.set()
    lines.append("<closed>")


def test_serve_drains_on_sigterm_and_stops_cleanly(server):
    """SIGTERM with two streams open: new requests get 503 with Retry-After while the short
    stream finishes; the long one is ended at the drain timeout by a chunk with finish_reason
    "error", an error event and [DONE]; then serve exits 0 and leaves no process behind."""
    assert server.child_pids and all(_alive(pid) for pid in server.child_pids)
    max_model_len = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    base = {"model": MODEL_NAME, "prompt": PROMPTS[0], "temperature": 0, "stream": True, "ignore_eos": True}
    streams = {"short": ({**base, "max_tokens": 2}, threading.Event(), []),  # one token left at the signal
               "long": ({**base, "max_tokens": max_model_len - 16}, threading.Event(), [])}
    threads = [threading.Thread(target=_stream_lines, args=(server.base_url, *spec), daemon=True)
               for spec in streams.values()]
    for thread in threads:
        thread.start()
    assert all(started.wait(120) for _, started, _ in streams.values())
    server.process.send_signal(signal.SIGTERM)
    signalled_s = time.monotonic()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.base_url}/health", timeout=10).json().get("status") != "draining":
        assert time.monotonic() < deadline, "the router did not start draining"
        time.sleep(0.05)
    refused = httpx.post(f"{server.base_url}/v1/completions", json={**base, "stream": False, "max_tokens": 2},
                         timeout=10)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "shutting_down"
    for thread in threads:
        thread.join(DRAIN_TIMEOUT_S + 60)
    cut_after_s = time.monotonic() - signalled_s

    short = streams["short"][2]
    assert short[-2:] == ["[DONE]", "<closed>"], short
    assert json.loads(short[-3]).get("choices", [{}])[0].get("finish_reason") == "length", short
    long = streams["long"][2]
    assert long[-2:] == ["[DONE]", "<closed>"], long[-4:]
    error_event = json.loads(long[-3])
    assert "shutting down" in error_event["error"]["message"], error_event
    assert json.loads(long[-4])["choices"][0]["finish_reason"] == "error"
    assert cut_after_s >= DRAIN_TIMEOUT_S - 1  # it was let run for the drain timeout

    assert server.process.wait(timeout=90) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in server.child_pids):
        time.sleep(0.1)
    assert not [pid for pid in server.child_pids if _alive(pid)], "orphaned service processes"
    for name in ("router", "attention-0", "expert-0", "expert-1"):
        events = [json.loads(line) for line in (server.log_dir / f"{name}.log").read_text().splitlines()
                  if line.startswith("{")]
        assert any(event["event"] in ("service.stopped", "router.stopped") for event in events), name
