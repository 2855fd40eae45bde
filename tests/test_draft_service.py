"""The draft worker as a real process over real sockets: Ready, features in, DraftTokens out,
garbage dropped without killing it, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio

from common.runtime.deployment import derive_endpoints, load_deployment
from common.runtime.supervisor import Supervisor
from common.wire import messages as m
from common.wire.transport import AsyncClient, Kind, pack_envelope

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "kjv-dsv4-mini"
CHILD = ("import sys; from common.runtime.deployment import load_deployment; from services.draft.main import run; "
         "sys.exit(run(load_deployment(sys.argv[1]), None, 'info'))")


@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="default model not present")
def test_draft_process_answers_requests_and_survives_garbage(tmp_path):
    config_path = tmp_path / "deploy.toml"
    config_path.write_text(f"""
[model]
path = "{MODEL}"
[paths]
run_dir = "{tmp_path}"
log_dir = "{tmp_path / 'logs'}"
[[attention]]
name = "attention-0"
[[expert]]
name = "expert-0"
[draft]
enabled = true
name = "draft"
""")
    endpoints = derive_endpoints(load_deployment(config_path))
    hidden = 256  # kjv-dsv4-mini hidden_size; 3 target layers
    features = torch.randn(12, 3 * hidden, generator=torch.Generator().manual_seed(0))

    async def scenario():
        context = zmq.asyncio.Context()
        supervisor = Supervisor(endpoints.supervisor, context=context)
        supervisor_task = asyncio.create_task(supervisor.run())
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(config_path)], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = AsyncClient(endpoints.draft, context=context, default_timeout_s=20)
        try:
            ready = await supervisor.wait_ready(["draft"], timeout_s=60)
            assert ready["draft"].role is m.ServiceRole.DRAFT and ready["draft"].pid == child.pid
            segment = m.FeatureSegment("r1", 0, 12, 0, tuple(range(12)))
            assert await client.request(m.TargetFeatures(step_id=0, segments=(segment,), features=features)) == m.Ack()
            request = m.DraftRequest(step_id=3, slots=(
                m.DraftSlot("r1", 5, (7,), 12),
                m.DraftSlot("r2", 5, (7,), 0, temperature=1.0, seed=5, first_output_position=0)))
            reply = await client.request(request)
            assert isinstance(reply, m.DraftTokens) and reply.step_id == 3
            greedy, sampled = reply.proposals
            assert greedy.request_id == "r1" and 1 <= len(greedy.token_ids) <= 5
            assert len(greedy.draft_probs) == len(greedy.confidences) == len(greedy.token_ids)
            assert len(sampled.support_token_ids) == len(sampled.token_ids) >= 1

            # malformed messages are dropped; the worker keeps answering, identically
            raw = context.socket(zmq.DEALER)
            raw.connect(endpoints.draft)
            await raw.send_multipart([b"junk"])
            await raw.send_multipart([pack_envelope(Kind.REQUEST, 1), b"\xff\x00garbage", b"more"])
            await raw.send_multipart([pack_envelope(Kind.REQUEST, 2), b"\x93\xadtarget_features\x01\x80"])
            await asyncio.sleep(0.2)
            raw.close(0)
            assert child.poll() is None
            assert await client.request(m.Ping(nonce=4)) == m.Pong(nonce=4, name="draft")
            assert await client.request(request) == reply  # same state, same seed: same proposals

            child.send_signal(signal.SIGTERM)
            exit_code = await asyncio.to_thread(child.wait, 20)
            assert exit_code == 0, child.stderr.read().decode()[-2000:]
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(5)
            await client.close()
            supervisor_task.cancel()
            supervisor.close()
            context.term()

    asyncio.run(scenario())
    log_text = (tmp_path / "logs" / "draft.log").read_text()
    assert "wire.dropped" in log_text and "draft.loaded" in log_text
