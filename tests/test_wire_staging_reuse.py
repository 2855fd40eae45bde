"""Regression: a staging buffer must not be reused while ANY of its frames is still queued in libzmq.

The message shape that broke the ZeroMQ data plane: a Dispatch of 64 tokens has frames
`[header, hidden (big, zero-copy), expert_ids (1.5 KB), weights (1.5 KB)]`. pyzmq copies frames
under `copy_threshold` (64 KiB) at once and returns only the LAST frame's tracker from
`send_multipart`, so the pool saw a finished tracker and handed the buffer out again while the
hidden frame still sat in the queue; the next message overwrote it and the peer received garbage.

Each test queues a message where nobody receives yet (a connect to an endpoint not yet bound),
then tries to take the buffer back and overwrite it as the next message would, then binds the
receiver and checks the bytes that arrive. Every blocking call has a bound; the module has a
pytest-timeout so a regression cannot hang CI.
"""

from __future__ import annotations

import asyncio
import socket as pysocket
import time

import pytest
import torch
import zmq
import zmq.asyncio

from common.wire import codec
from common.wire import messages as m
from common.wire.errors import ReplyTimeout, StagingExhausted
from common.wire.staging import SendStagingPool, StagingConfig, send_staged
from common.wire.transport import AsyncClient, SyncClient

pytestmark = pytest.mark.timeout(60)

NUM_TOKENS, TOP_K, HIDDEN = 64, 6, 1024  # T, K, D: hidden 256 KiB (zero-copy), ids/weights 1.5 KiB (copied)
JUNK_BYTE = 0xAB
RECV_TIMEOUT_MS = 5000


def _dispatch(seed: int) -> m.Dispatch:
    generator = torch.Generator().manual_seed(seed)
    return m.Dispatch(
        dispatch_id=seed, step_id=0, layer=3, micro_batch=0,
        hidden=torch.randn(NUM_TOKENS, HIDDEN, generator=generator),  # [T, D] f32
        expert_ids=torch.randint(0, 256, (NUM_TOKENS, TOP_K), dtype=torch.int32, generator=generator),  # [T, K]
        weights=torch.rand(NUM_TOKENS, TOP_K, generator=generator),  # [T, K] f32
    )


def _assert_same_dispatch(received: m.Dispatch, sent: m.Dispatch) -> None:
    assert received.dispatch_id == sent.dispatch_id
    assert torch.equal(received.hidden, sent.hidden), "hidden frame overwritten while queued"
    assert torch.equal(received.expert_ids, sent.expert_ids)
    assert torch.equal(received.weights, sent.weights)


def _reuse_like_the_next_message(pool: SendStagingPool) -> bool:
    """Take a buffer back (briefly) and fill it with junk, as encoding the next message would.
    True when the pool handed one out; a correct pool refuses while the message is queued."""
    try:
        lease = pool.acquire(max_wait_s=0.2)
    except StagingExhausted:
        return False
    pool.storages[lease.index].fill_(JUNK_BYTE)
    lease.release_after(None)
    return True


def _wait_all_free(pool: SendStagingPool, bound_s: float = 5.0) -> None:
    """ZeroMQ's gc thread marks a send done a moment after libzmq let go of it; wait, bounded."""
    deadline = time.monotonic() + bound_s
    while pool.num_free < pool.config.num_buffers and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pool.num_free == pool.config.num_buffers


def _free_tcp_port() -> int:
    with pysocket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(params=["ipc", "tcp", "inproc"])
def address(request, tmp_path):
    if request.param == "ipc":
        return f"ipc://{tmp_path}/reuse.sock"
    if request.param == "tcp":
        return f"tcp://127.0.0.1:{_free_tcp_port()}"
    return f"inproc://reuse-{time.monotonic_ns()}"


def test_send_staged_keeps_the_buffer_until_every_frame_is_sent(address):
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(address)  # nobody bound yet: the message stays queued in libzmq
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pool = SendStagingPool(StagingConfig(num_buffers=1, buffer_bytes=1 << 20, max_wait_s=0.2))
    sent = _dispatch(1)
    try:
        send_staged(push, pool, lambda writer: codec.encode(sent, tensor_writer=writer))
        assert pool.num_in_flight == 1, "the buffer was returned while its big frame is queued"
        reused = _reuse_like_the_next_message(pool)

        pull.bind(address)
        assert pull.poll(RECV_TIMEOUT_MS, zmq.POLLIN), "the queued message never arrived"
        frames = pull.recv_multipart(copy=False)
        _assert_same_dispatch(codec.decode(frames), sent)
        assert not reused
        del frames  # inproc passes the frames themselves: the buffer is free once the receiver drops them
        _wait_all_free(pool)
    finally:
        push.close(0)
        pull.close(0)
        context.term()


def test_sync_client_staged_request_keeps_the_buffer_until_sent(tmp_path):
    address = f"ipc://{tmp_path}/expert.sock"
    context = zmq.Context()
    client = SyncClient(address, context=context)
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    pool = SendStagingPool(StagingConfig(num_buffers=1, buffer_bytes=1 << 20, max_wait_s=0.2))
    sent = _dispatch(2)
    try:
        with pytest.raises(ReplyTimeout):  # nobody is bound: the request is queued, no reply comes
            client.request(sent, timeout_s=0.2, staging=pool)
        reused = _reuse_like_the_next_message(pool)

        server.bind(address)
        assert server.poll(RECV_TIMEOUT_MS, zmq.POLLIN)
        frames = server.recv_multipart(copy=False)  # [peer, envelope, header, *tensors]
        _assert_same_dispatch(codec.decode(frames[2:]), sent)
        assert not reused
        _wait_all_free(pool)
    finally:
        client.close()
        server.close(0)
        context.term()


def test_async_client_staged_request_keeps_the_buffer_until_sent(tmp_path):
    address = f"ipc://{tmp_path}/expert.sock"
    sent = _dispatch(3)
    pool = SendStagingPool(StagingConfig(num_buffers=1, buffer_bytes=1 << 20, max_wait_s=0.2))
    sync_context = zmq.Context()
    server = sync_context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        client = AsyncClient(address, context=context)
        try:
            with pytest.raises(ReplyTimeout):  # nobody is bound: the request is queued, no reply comes
                await client.request(sent, timeout_s=0.2, staging=pool)
            reused = _reuse_like_the_next_message(pool)

            server.bind(address)  # libzmq's I/O threads deliver it; the event loop need not run
            assert server.poll(RECV_TIMEOUT_MS, zmq.POLLIN)
            frames = server.recv_multipart(copy=False)  # [peer, envelope, header, *tensors]
            _assert_same_dispatch(codec.decode(frames[2:]), sent)
            assert not reused
            _wait_all_free(pool)
        finally:
            await client.close()
            context.term()

    try:
        asyncio.run(scenario())
    finally:
        server.close(0)
        sync_context.term()
