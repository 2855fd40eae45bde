"""The draft worker as a real process over real sockets: Ready, features in, DraftTokens out,
garbage dropped without killing it, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch
import zmq

from moemesh.common.wire import messages as m
from moemesh.common.wire.transport import Kind, pack_envelope
from draft_support import REPO_ROOT, running_draft_worker, write_draft_deployment

MODEL = REPO_ROOT / "models" / "kjv-dsv4-mini"


@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="default model not present")
def test_draft_process_answers_requests_and_survives_garbage(tmp_path):
    config_path = write_draft_deployment(tmp_path, MODEL)
    hidden = 256  # kjv-dsv4-mini hidden_size; 3 target layers
    features = torch.randn(12, 3 * hidden, generator=torch.Generator().manual_seed(0))

    async def scenario():
        async with running_draft_worker(config_path) as (context, endpoints, client, ready, child):
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

    asyncio.run(scenario())
    log_text = (tmp_path / "logs" / "draft.log").read_text()
    assert "wire.dropped" in log_text and "draft.loaded" in log_text
