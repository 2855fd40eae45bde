"""What feeds the status page, without a browser or workers (fast):

- the attention worker's RoutingCounter puts the raw [layer][expert] counts (every phase summed)
  into its RoutingSummary, and they survive the wire codec inside a StepResult;
- `/status.json` takes the heat map from the engine's latest routing summary (a file's counts
  only as a fallback), never leaks the summary object into the JSON, counts requests by
  outcome, and shows `moemesh serve`'s restart record, which `/health` also carries.
The gateway is the real app (build_app) over the scripted engine of router_support.
"""

from __future__ import annotations

import os

import torch
from router_support import ScriptedEngine, tiny_tokenizer
from starlette.testclient import TestClient

from moemesh.common.chat import tokens as tk
from moemesh.common.runtime.restart_record import ChildRestarts, restarts_path_for, write_restarts
from moemesh.common.wire.codec import decode, encode
from moemesh.common.wire.messages import SequenceResult, StepResult
from moemesh.services.attention.routing_stats import RoutingCounter
from moemesh.services.router.app import build_app
from moemesh.services.router.gateway_config import GatewayConfig
from moemesh.services.router.status_page import StatusSources

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)


def _summary():
    counter = RoutingCounter(num_layers=2, num_experts=4, num_experts_per_tok=2, device=torch.device("cpu"))
    # layer 0: one prefill token (experts 0, 1), one decode token (experts 1, 3)
    counter.add(0, torch.tensor([[0, 1], [1, 3]]), torch.tensor([False, True]))
    # layer 1: two tokens, phase unknown (counted as prefill)
    counter.add(1, torch.tensor([[2, 3], [2, 0]]), None)
    counter.step_done()
    return counter.summary()


def test_routing_summary_carries_counts_per_layer_and_expert_over_the_wire():
    summary = _summary()
    assert summary.layer_counts == ((1, 2, 0, 1), (1, 0, 2, 1))  # phases summed
    result = StepResult(step_id=7, sequences=(SequenceResult("r", (5,)),), routing=summary)
    decoded = decode(encode(result))
    assert decoded.routing.layer_counts == summary.layer_counts
    assert decoded.routing.layers == summary.layers


class _EngineWithRouting(ScriptedEngine):
    routing_summary = None

    def stats(self) -> dict:
        stats = super().stats()
        if self.routing_summary is not None:
            stats["routing_summary"] = self.routing_summary
        return stats


def _client(tmp_path, engine, **sources) -> TestClient:
    config = GatewayConfig(model_name="dsv4-flash", max_model_len=256, eos_token_ids=(EOS,))
    app = build_app(config, engine, TOKENIZER)
    app.state.status_sources = StatusSources(progress_dir=str(tmp_path / "progress"), **sources)
    return TestClient(app)


def test_status_json_heat_map_requests_and_restarts(tmp_path):
    engine = _EngineWithRouting(TOKENIZER.encode("a b c", add_special_tokens=False).ids + [EOS], eos_id=EOS)
    client = _client(tmp_path, engine, layer_heat=[[9, 9, 9, 9]])
    status = client.get("/status.json").json()
    assert status["layer_heat"] == [[9, 9, 9, 9]]  # no live counts yet: the file's fallback
    assert status["requests"] == {} and status["restarts"] == {}
    assert status["router"]["pid"] == os.getpid() and status["router"]["uptime_s"] >= 0  # TestClient: in-process
    assert "restarts" not in client.get("/health").json()

    engine.routing_summary = _summary()
    reply = client.post("/v1/completions", json={"model": "dsv4-flash", "prompt": "x", "max_tokens": 8})
    assert reply.status_code == 200
    write_restarts(restarts_path_for(tmp_path), {"expert-0": ChildRestarts(
        num_restarts=2, last_exit_code=-9, last_restart_unix_s=1.0, pid=4242)})
    status = client.get("/status.json").json()
    assert status["layer_heat"] == [[1, 2, 0, 1], [1, 0, 2, 1]]  # live counts win over the file
    assert "routing_summary" not in status["engine"] and status["engine"]["num_running"] == 3
    assert status["requests"] == {"ok": 1}
    assert status["restarts"]["expert-0"] == {"num_restarts": 2, "last_exit_code": -9, "last_restart_unix_s": 1.0,
                                              "pid": 4242, "gave_up": False}
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["restarts"] == {"expert-0": 2}
    page = client.get("/").text
    assert 'id="heat"' in page and "fetch(\"/status.json\")" in page  # static: its script renders the JSON
