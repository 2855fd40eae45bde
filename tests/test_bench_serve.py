"""`moemesh bench serve` against the real gateway on a uvicorn server (localhost, free port),
driven by a scripted engine with known delays so the measured figures can be checked."""

from __future__ import annotations

import json
import math
import socket
import statistics
import threading
import time

import pytest
import uvicorn
from router_support import ScriptedEngine, tiny_tokenizer

from moemesh.bench import serve
from moemesh.bench.serve_client import RequestRecord
from moemesh.bench.serve_metrics import SloLimits, parse_goodput, summarize
from moemesh.bench.timing import percentile
from moemesh.bench.serve_workload import (Arrival, PromptTrimmer, WorkloadRequest, arrival_offsets_s, file_requests,
                                  random_requests)
from moemesh.common.chat import tokens as tk
from moemesh.services.router.app import build_app
from moemesh.services.router.engine_client import EngineError
from moemesh.services.router.gateway_config import GatewayConfig

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)
MODEL = "dsv4-flash"
TEXT_IDS = TOKENIZER.encode("The quick brown fox jumps over the lazy dog. " * 4, add_special_tokens=False).ids
NUM_BEFORE_EOS = 6
SCRIPT = TEXT_IDS[:NUM_BEFORE_EOS] + [EOS] + TEXT_IDS[NUM_BEFORE_EOS:]


class BenchEngine(ScriptedEngine):
    """The scripted engine, plus: every `fail_every`-th submission raises EngineError, and
    the most sequences generating at once is recorded (to check the client's cap)."""

    def __init__(self) -> None:
        super().__init__(SCRIPT, eos_id=EOS)
        self.reset()

    def reset(self) -> None:
        self.step_delay_s = self.first_token_delay_s = 0.0
        self.fail = self.fail_in_stream = False
        self.fail_every: int | None = None
        self.submitted.clear()
        self.num_submissions = self.num_running = self.max_running = 0

    async def submit(self, request):
        self.num_submissions += 1
        if self.fail_every and self.num_submissions % self.fail_every == 0:
            raise EngineError("scripted failure")
        return await super().submit(request)

    async def _run(self, request):
        self.num_running += 1
        self.max_running = max(self.max_running, self.num_running)
        try:
            async for event in super()._run(request):
                yield event
        finally:
            self.num_running -= 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    engine = BenchEngine()
    config = GatewayConfig(MODEL, max_model_len=1 << 16, eos_token_ids=(EOS,), keep_alive_interval_s=0.2)
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
    engine.reset()
    return engine


def run_bench(server, tmp_path, *args: str) -> tuple[int, dict]:
    """Run `moemesh bench serve` in-process; return its exit code and the JSON it wrote."""
    _, base_url = server
    out_dir = tmp_path / "results"
    code = serve.main(["--base-url", base_url, "--result-dir", str(out_dir), *args])
    files = sorted(out_dir.glob("serve-*.json")) if out_dir.exists() else []
    return code, json.loads(files[-1].read_text()) if files else {}


# --- pure parts: schedule and metric arithmetic ------------------------------------------

def test_poisson_schedule_statistics_and_determinism():
    offsets = arrival_offsets_s(4001, 20.0, Arrival.POISSON, seed=7)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)  # mean gap 1 / rate
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.08)  # exponential: CV 1
    assert statistics.median(gaps) == pytest.approx(math.log(2) / 20, rel=0.08)
    assert offsets == arrival_offsets_s(4001, 20.0, Arrival.POISSON, seed=7)
    assert offsets != arrival_offsets_s(4001, 20.0, Arrival.POISSON, seed=8)
    assert arrival_offsets_s(4, 4.0, Arrival.FIXED, seed=0) == [0.0, 0.25, 0.5, 0.75]
    assert arrival_offsets_s(3, math.inf, Arrival.POISSON, seed=0) == [0.0, 0.0, 0.0]


def test_metric_math_on_known_timings():
    fast = RequestRecord(0, start_s=10.0, end_s=10.3, chunk_times_s=[10.1, 10.15, 10.25],
                         num_prompt_tokens=20, num_output_tokens=4, usage_reported=True)
    slow = RequestRecord(1, start_s=10.0, end_s=11.0, chunk_times_s=[10.5], num_prompt_tokens=30,
                         num_output_tokens=1, usage_reported=True)
    broken = RequestRecord(2, start_s=10.0, error="HTTP 503: down")
    metrics = summarize([fast, slow, broken], duration_s=2.0, percentiles=(50, 75), slo=parse_goodput(["ttft:200"]),
                        max_concurrency_reached=3)
    assert (metrics["completed"], metrics["failed"]) == (2, 1)
    assert metrics["errors"] == ["request 2: HTTP 503: down"]
    assert metrics["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert metrics["tpot_ms"]["count"] == 1  # a one-token request has no TPOT
    assert metrics["tpot_ms"]["mean"] == pytest.approx((300 - 100) / 3)
    assert metrics["itl_ms"]["count"] == 2 and metrics["itl_ms"]["median"] == pytest.approx(75.0)
    assert metrics["e2el_ms"]["p75"] == pytest.approx(300 + 0.75 * 700)
    assert metrics["request_throughput"] == 1.0 and metrics["request_goodput"] == 0.5
    assert metrics["output_throughput"] == 2.5 and metrics["total_token_throughput"] == 27.5
    assert percentile([1, 2, 3, 4], 0.9) == pytest.approx(3.7)
    assert SloLimits(max_tpot_ms=1.0).met_by(slow) and not SloLimits(max_tpot_ms=60.0).met_by(fast)
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])


def test_random_and_file_workloads(tmp_path):
    requests = random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    assert requests == random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    assert all(50 <= len(r.prompt.split()) <= 150 and 10 <= r.max_tokens <= 30 for r in requests)
    assert len({r.prompt.split()[0] + r.prompt.split()[1] for r in requests}) > 40
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    loaded = file_requests(path, 3, default_max_tokens=9)
    assert loaded[0] == WorkloadRequest("hello", None, 3, None) == loaded[2]
    assert loaded[1].messages == ({"role": "user", "content": "hi"},) and loaded[1].max_tokens == 9
    tokenizer_path = tmp_path / "tokenizer.json"
    tokenizer_path.write_text(TOKENIZER.to_str())
    trimmed = random_requests(20, input_len=40, output_len=4, range_ratio=0.0, seed=2,
                              trimmer=PromptTrimmer(tokenizer_path))
    assert [len(TOKENIZER.encode(r.prompt, add_special_tokens=False).ids) for r in trimmed] == [40] * 20
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 1"):
        file_requests(path, 1, default_max_tokens=9)


# --- against the server ------------------------------------------------------------------

def test_timings_match_the_engine_delays(server, engine, tmp_path):
    engine.first_token_delay_s, engine.step_delay_s = 0.1, 0.03
    code, result = run_bench(server, tmp_path, "--num-prompts", "4", "--random-input-len", "16",
                             "--random-output-len", "6", "--ignore-eos", "--percentiles", "50,90,99,99.9")
    assert code == 0
    metrics = result["raw"]["metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (4, 0, 24)
    assert metrics["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in engine.submitted)
    assert metrics["itl_ms"]["count"] == 4 * 5  # one event per token: the script's first 6 are words
    # lower bounds are guaranteed by the delays; upper bounds are loose because CI machines are loaded
    assert 25 <= metrics["itl_ms"]["median"] <= 250
    assert 25 <= metrics["tpot_ms"]["mean"] <= 250
    assert 120 <= metrics["ttft_ms"]["median"] <= 1500  # first-token delay + one step
    assert 270 <= metrics["e2el_ms"]["median"] <= 3000  # + 5 more steps
    assert "p99.9" in metrics["e2el_ms"] and result["raw"]["config"]["model"] == MODEL
    assert metrics["output_throughput"] == pytest.approx(24 / metrics["duration_s"])
    assert result["benchmark"] == "serve" and result["ratios"]["completed_fraction"] == 1.0
    assert len(result["raw"]["requests"]) == 4 and all(r["ok"] for r in result["raw"]["requests"])


def test_ignore_eos_is_sent_and_honoured(server, engine, tmp_path):
    args = ("--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "12", "--no-write")
    assert run_bench(server, tmp_path, *args) == (0, {})  # --no-write: no file
    assert [len(engine.tokens_for(r)) for r in engine.submitted] == [NUM_BEFORE_EOS + 1] * 2
    engine.submitted.clear()
    code, result = run_bench(server, tmp_path, *args[:-1], "--ignore-eos", "--endpoint", "completions")
    assert code == 0 and result["raw"]["metrics"]["total_output_tokens"] == 24
    assert all(r.sampling_params.ignore_eos for r in engine.submitted)


def test_finish_only_event_adds_no_token_gap(server, engine, tmp_path):
    # Chat with ignore_eos, 7 tokens: 6 words, then the script's EOS, whose text chat never shows,
    # so the stream is 6 word events, then one event with only finish_reason "length".
    code, result = run_bench(server, tmp_path, "--num-prompts", "2", "--random-input-len", "8",
                             "--random-output-len", "7", "--ignore-eos")
    metrics = result["raw"]["metrics"]
    assert code == 0 and metrics["total_output_tokens"] == 14  # tokens from usage, not from events
    assert metrics["itl_ms"]["count"] == 2 * (NUM_BEFORE_EOS - 1)


def test_concurrency_cap_is_respected(server, engine, tmp_path):
    engine.step_delay_s = 0.02
    common = ("--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos")
    code, capped = run_bench(server, tmp_path, *common, "--max-concurrency", "2")
    assert code == 0 and capped["raw"]["metrics"]["completed"] == 6
    assert capped["raw"]["metrics"]["max_concurrency_reached"] == 2 and engine.max_running == 2
    engine.max_running = 0
    code, _ = run_bench(server, tmp_path, *common, "--no-write")
    assert code == 0 and engine.max_running == 6


def test_warmup_requests_are_sent_first_and_left_out(server, engine, tmp_path):
    code, result = run_bench(server, tmp_path, "--num-prompts", "3", "--warmup-requests", "2", "--max-concurrency",
                             "1", "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos")
    metrics = result["raw"]["metrics"]
    assert code == 0 and len(engine.submitted) == 5  # 2 warm-up + 3 timed
    assert (metrics["num_requests"], metrics["completed"], metrics["total_output_tokens"]) == (3, 3, 12)
    assert len(result["raw"]["requests"]) == 3 and result["raw"]["config"]["warmup_requests"] == 2
    timed_prompts = {tuple(r.prompt_token_ids) for r in engine.submitted[2:]}
    assert not timed_prompts & {tuple(r.prompt_token_ids) for r in engine.submitted[:2]}  # other prompts


def test_fixed_rate_spreads_the_sends(server, engine, tmp_path):
    code, result = run_bench(server, tmp_path, "--num-prompts", "5", "--request-rate", "20", "--arrival", "fixed",
                             "--random-input-len", "8", "--random-output-len", "2")
    metrics = result["raw"]["metrics"]
    assert code == 0 and metrics["completed"] == 5
    assert metrics["duration_s"] >= 0.2  # the last request is sent 4 / 20 s after the first
    assert metrics["max_concurrency_reached"] <= 2  # each finishes well before the next is due


def test_failed_requests_are_counted(server, engine, tmp_path):
    engine.fail_every = 2
    code, result = run_bench(server, tmp_path, "--num-prompts", "6", "--random-input-len", "8",
                             "--random-output-len", "5", "--ignore-eos", "--max-concurrency", "1")
    metrics = result["raw"]["metrics"]
    assert code == 0 and (metrics["completed"], metrics["failed"]) == (3, 3)
    assert metrics["total_output_tokens"] == 15 and metrics["tpot_ms"]["count"] == 3
    assert len(metrics["errors"]) == 3 and all("HTTP 503" in e and "scripted failure" in e for e in metrics["errors"])
    assert result["ratios"]["completed_fraction"] == 0.5
    engine.reset()
    engine.fail_in_stream = True
    code, result = run_bench(server, tmp_path, "--num-prompts", "2", "--random-input-len", "8", "--no-write")
    assert code == 1  # nothing completed


def test_goodput_against_slos(server, engine, tmp_path):
    engine.step_delay_s = 0.02
    common = ("--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "5", "--ignore-eos")
    _, strict = run_bench(server, tmp_path, *common, "--goodput", "tpot:1")
    assert strict["raw"]["metrics"]["request_goodput"] == 0.0
    assert strict["raw"]["config"]["slo"]["tpot_ms"] == 1.0
    _, loose = run_bench(server, tmp_path, *common, "--goodput", "tpot:5000", "ttft:5000", "e2el:9000")
    metrics = loose["raw"]["metrics"]
    assert metrics["request_goodput"] == pytest.approx(metrics["request_throughput"])
    assert loose["ratios"]["goodput_over_throughput"] == pytest.approx(1.0)


def test_file_dataset_on_chat(server, engine, tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Hello world", "max_tokens": 3},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
              "max_tokens": 5},
             {"prompt": "no limit given"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, result = run_bench(server, tmp_path, "--dataset", "file", "--dataset-path", str(path), "--num-prompts", "3",
                             "--random-output-len", "4", "--ignore-eos", "--max-concurrency", "1")
    assert code == 0
    assert sorted(r.sampling_params.max_tokens for r in engine.submitted) == [3, 4, 5]
    metrics = result["raw"]["metrics"]
    assert metrics["total_output_tokens"] == 12
    assert metrics["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in engine.submitted)


def test_unreachable_server_and_bad_arguments(tmp_path):
    port = free_port()  # nothing listens there
    assert serve.main(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--no-write"]) == 1
    with pytest.raises(SystemExit):
        serve.main(["--goodput", "ttft=5"])
    with pytest.raises(SystemExit):
        serve.main(["--dataset", "file"])
