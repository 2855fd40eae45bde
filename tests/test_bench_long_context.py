"""`moemesh bench long-context`: its floors and capacity arithmetic, and one run against the real gateway over a
scripted engine whose prefill takes time in proportion to the prompt (so the figures can be checked)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from router_support import ScriptedEngine, tiny_tokenizer

from moemesh.bench import long_context
from moemesh.common.model.presets import preset_config
from moemesh.services.router.app import build_app
from moemesh.services.router.gateway_config import GatewayConfig

TOKENIZER = tiny_tokenizer()
SCRIPT = TOKENIZER.encode("one two three four five six seven eight nine ten " * 3, add_special_tokens=False).ids
PREFILL_S_PER_TOKEN = 20e-6  # 4,096 tokens: 82 ms
STEP_S = 0.002


class PrefillEngine(ScriptedEngine):
    """Prefill in proportion to the prompt, one request prefilling at a time (as one scheduler step stream),
    the stats the benchmark reads."""

    def __init__(self) -> None:
        super().__init__(SCRIPT, eos_id=-1, step_delay_s=STEP_S)
        self.num_running = 0
        self.prefill_lock = asyncio.Lock()

    async def _run(self, request):
        self.num_running += 1
        try:
            async with self.prefill_lock:
                await asyncio.sleep(len(request.prompt_token_ids) * PREFILL_S_PER_TOKEN)
            async for event in super()._run(request):
                yield event
        finally:
            self.num_running -= 1

    def stats(self) -> dict:
        return {"num_waiting": 0, "num_running": self.num_running, "kv_blocks_used": {"gpu": 0, "cpu": 0},
                "kv_blocks_total": {"gpu": 1000, "cpu": 24}, "kv_block_size_tokens": 128, "max_model_len": 16384}


def test_capacity_counts_whole_blocks_per_sequence():
    engine = {"kv_block_size_tokens": 128, "kv_blocks_total": {"gpu": 8193, "cpu": 1024}, "max_model_len": 99}
    cap = long_context.capacity(engine, None)
    assert cap["device_tokens"] == 8193 * 128 and cap["cpu_tier_tokens"] == 1024 * 128
    assert cap["sequences_that_fit"]["131072"] == {"device": 8, "device_and_cpu_tier": 9}
    assert cap["sequences_that_fit"]["1048576"] == {"device": 1, "device_and_cpu_tier": 1}


def test_floors_grow_with_context_and_fp8_reads_fewer_bytes():
    config = preset_config("v4-flash")
    short, long = (long_context.decode_step_bytes(config, n, "fp8") for n in (4096, 131072))
    assert long["weight_bytes"] == short["weight_bytes"] > 0 and long["routed_expert_bytes"] > 0
    assert long["kv_bytes"] > short["kv_bytes"] > 0
    assert long_context.decode_step_bytes(config, 131072, "bf16")["kv_bytes"] > long["kv_bytes"]
    # the attention core makes prefill FLOPs grow faster than the prompt
    assert long_context.prefill_floor_s(config, 131072, 1e15) > 2 * long_context.prefill_floor_s(config, 65536, 1e15)


@pytest.fixture(scope="module")
def server():
    engine = PrefillEngine()
    config = GatewayConfig("lc", max_model_len=16384, eos_token_ids=(), keep_alive_interval_s=0.2)
    port = long_context_port()
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


def long_context_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model_dir(tmp_path):
    """A V4-Flash config of four layers (two window layers, then CSA and HCA) over the served vocabulary."""
    from moemesh.common.model.presets import PRESETS

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    hub = PRESETS["v4-flash"]()
    hub["num_hidden_layers"] = 4
    hub["vocab_size"] = TOKENIZER.get_vocab_size()  # prompts are drawn from the served vocabulary
    (model_dir / "config.json").write_text(json.dumps(hub))
    return model_dir


def test_a_run_measures_prefill_decode_and_ttft_under_prefill(server, tmp_path):
    _, base_url = server
    model_dir = _model_dir(tmp_path)
    code = long_context.main(["--base-url", base_url, "--model-dir", str(model_dir), "--lengths", "2048,8192",
                              "--decode-tokens", "6", "--probes", "3", "--out-dir", str(tmp_path / "out")])
    assert code == 0
    record = json.loads(next((tmp_path / "out").glob("long-context-*.json")).read_text())
    raw = record["raw"]
    assert raw["capacity"]["device_tokens"] == 128_000 and raw["capacity"]["max_model_len"] == 16384
    runs = {run["prompt_tokens"]: run for run in raw["long_requests"]}
    assert runs[8192]["ttft_s"] >= 8192 * PREFILL_S_PER_TOKEN
    assert runs[8192]["ttft_s"] > runs[2048]["ttft_s"]
    assert runs[2048]["output_tokens"] == 6 and runs[2048]["decode_step_s"] >= STEP_S * 0.9
    assert runs[8192]["decode_floor"]["kv_bytes"] > runs[2048]["decode_floor"]["kv_bytes"]
    # probes queue behind the long prefill (one prefill at a time here): their TTFT is well above idle
    under = raw["under_prefill"]
    assert under["probe_ttfts_s"] and under["long"]["output_tokens"] == 6
    assert record["ratios"]["short_ttft_under_prefill_over_idle"] > 1.5
    assert raw["rates"] is None and "prefill_fraction_of_bf16_floor/2048" not in record["ratios"]


def test_lengths_past_the_server_limit_stop_before_sending(server, tmp_path):
    _, base_url = server
    with pytest.raises(SystemExit, match="max_model_len 16384"):
        long_context.main(["--base-url", base_url, "--model-dir", str(_model_dir(tmp_path)), "--lengths", "16384",
                           "--out-dir", str(tmp_path)])
