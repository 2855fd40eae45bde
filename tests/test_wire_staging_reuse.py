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

from moemesh.common.wire import codec
from moemesh.common.wire import messages as m
from moemesh.common.wire.errors import ReplyTimeout, StagingExhausted
from moemesh.common.wire.staging import SendStagingPool, StagingConfig, send_staged
from moemesh.common.wire.tracked_send import TrackedMessage
from moemesh.common.wire.transport import AsyncClient, SyncClient

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


def _reuse_like_the_next_message_beyond(pool: SendStagingPool, num_allowed: int) -> bool:
    """Lease `num_allowed` free buffers (and give them back untouched), then try one more like
    `_reuse_like_the_next_message`: True when a buffer still in flight was handed out."""
    leases = [pool.acquire(max_wait_s=0.1) for _ in range(num_allowed)]
    try:
        return _reuse_like_the_next_message(pool)
    finally:
        for lease in leases:
            lease.release_after(None)


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
        num_in_flight = pool.num_in_flight
        reused = _reuse_like_the_next_message(pool)

        pull.bind(address)
        assert pull.poll(RECV_TIMEOUT_MS, zmq.POLLIN), "the queued message never arrived"
        frames = pull.recv_multipart(copy=False)
        _assert_same_dispatch(codec.decode(frames), sent)
        assert not reused and num_in_flight == 1
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


# ----------------------------------------------------------------------------- TrackedMessage itself
def _wait_done(tracker: zmq.MessageTracker, bound_s: float = 5.0) -> bool:
    try:
        tracker.wait(bound_s)
    except zmq.NotDone:
        return False
    return True


def test_tracker_covers_every_zero_copy_frame_not_just_the_last(tmp_path):
    """[big, small, big, small]: both big frames are tracked, the small ones copied at once; the
    tracker stays pending while the message is queued and ends after delivery."""
    big_first, big_second = bytearray(b"\x01" * (128 << 10)), bytearray(b"\x02" * (96 << 10))
    small_first, small_second = bytearray(b"\x03" * 100), bytearray(b"\x04" * 10)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/tracked.sock"
    push.connect(address)
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    try:
        outgoing = TrackedMessage([b"header", memoryview(big_first), memoryview(small_first),
                                   memoryview(big_second), memoryview(small_second)])
        assert outgoing.num_zero_copy_frames == 2
        tracker = outgoing.send(push)
        assert tracker is outgoing.tracker
        assert not _wait_done(tracker, 0.2), "done while the big frames are queued"
        small_first[:] = b"\xff" * 100  # the small frames were copied: changing them now is allowed
        small_second[:] = b"\xff" * 10
        pull.bind(address)
        assert pull.poll(RECV_TIMEOUT_MS, zmq.POLLIN)
        received = pull.recv_multipart()
        assert received == [b"header", b"\x01" * (128 << 10), b"\x03" * 100, b"\x02" * (96 << 10), b"\x04" * 10]
        assert _wait_done(tracker), "never done after delivery"
        with pytest.raises(RuntimeError, match="sent once"):
            outgoing.send(push)
    finally:
        push.close(0)
        pull.close(0)
        context.term()


def test_unsent_or_failed_messages_release_their_buffers():
    """The tracker also waits for OUR frames: pending while an unsent message holds them, done
    once it is discarded, and done after a failed send even while the exception (whose traceback
    sees the send's locals) is still alive."""
    buffer = bytearray(256 << 10)
    unsent = TrackedMessage([memoryview(buffer)])
    assert not _wait_done(unsent.tracker, 0.1)
    unsent.discard()
    assert _wait_done(unsent.tracker)

    context = zmq.Context()
    closed = context.socket(zmq.PUSH)
    closed.close(0)
    failing = TrackedMessage([memoryview(buffer)])
    with pytest.raises(zmq.ZMQError) as failure:
        failing.send(closed)
    assert failure.value is not None and _wait_done(failing.tracker)
    context.term()


def test_asyncio_send_queued_at_the_high_water_mark_then_cancelled(tmp_path):
    """An asyncio send that cannot go out at once waits in pyzmq's queue holding our Frames: the
    sent messages arrive intact after their buffers were refused to newcomers, and the cancelled
    one's buffer comes back without ever being sent."""
    address = f"ipc://{tmp_path}/hwm.sock"
    pool = SendStagingPool(StagingConfig(num_buffers=3, buffer_bytes=1 << 20, max_wait_s=0.1))
    first, cancelled, last = _dispatch(10), _dispatch(11), _dispatch(12)

    def stage(message: m.Dispatch) -> TrackedMessage:
        return pool.stage(lambda writer: codec.encode(message, tensor_writer=writer))

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 1)
        push.connect(address)  # unbound: the first message fills the one-message queue
        pull = context.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        try:
            await asyncio.wait_for(stage(first).send_async(push), 1.0)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(stage(cancelled).send_async(push), 0.2)
            deadline = time.monotonic() + 5.0
            while pool.num_free < 2 and time.monotonic() < deadline:  # the cancelled one's buffer returns
                await asyncio.sleep(0.005)
            assert pool.num_free == 2 and pool.num_in_flight == 1
            pending = asyncio.ensure_future(stage(last).send_async(push))  # queued behind `first`
            await asyncio.sleep(0.05)
            assert not pending.done() and pool.num_free == 1
            assert not _reuse_like_the_next_message_beyond(pool, num_allowed=1)

            pull.bind(address)
            for sent in (first, last):
                frames = await asyncio.wait_for(pull.recv_multipart(copy=False), RECV_TIMEOUT_MS / 1000)
                _assert_same_dispatch(codec.decode(frames), sent)
            await asyncio.wait_for(pending, 5.0)
            assert not await pull.poll(100, zmq.POLLIN)  # the cancelled message never went out
        finally:
            push.close(0)
            pull.close(0)
            context.term()

    asyncio.run(scenario())
    _wait_all_free(pool)


def test_async_server_staged_replies_from_one_buffer_stay_intact(tmp_path):
    """Many overlapping requests answered by AsyncServer from ONE staging buffer with replies whose
    last frames are small: each reply must wait for the previous one's frames, and all arrive intact."""
    from moemesh.common.wire.transport import AsyncServer

    address = f"ipc://{tmp_path}/server.sock"
    num_requests = 24
    pool = SendStagingPool(StagingConfig(num_buffers=1, buffer_bytes=1 << 20, max_wait_s=5.0))

    async def serve(server: AsyncServer) -> None:
        for _ in range(num_requests):
            incoming = await server.recv()
            await server.reply(incoming, _dispatch(incoming.message.nonce), staging=pool)

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        server = AsyncServer(address, context=context)
        client = AsyncClient(address, context=context, default_timeout_s=20)
        serving = asyncio.ensure_future(serve(server))
        try:
            replies = await asyncio.gather(*(client.request(m.Ping(nonce=index)) for index in range(num_requests)))
            for index, reply in enumerate(replies):
                _assert_same_dispatch(reply, _dispatch(index))
            await asyncio.wait_for(serving, 5.0)
        finally:
            serving.cancel()
            await client.close()
            server.close()
            context.term()

    asyncio.run(scenario())
    assert pool.num_leases == num_requests
    _wait_all_free(pool)


def test_acquire_takes_a_finished_buffer_while_an_older_send_is_still_queued(tmp_path):
    """Head-of-line: the oldest send is stuck (nobody bound), a newer one was delivered; acquire
    must hand out the newer one's buffer at once, not after waiting out the stuck one."""
    context = zmq.Context()
    stuck, flowing, pull = context.socket(zmq.PUSH), context.socket(zmq.PUSH), context.socket(zmq.PULL)
    for socket in (stuck, flowing, pull):
        socket.setsockopt(zmq.LINGER, 0)
    pool = SendStagingPool(StagingConfig(num_buffers=2, buffer_bytes=1 << 20, max_wait_s=3.0))
    try:
        stuck.connect(f"ipc://{tmp_path}/nobody.sock")
        pull.bind(f"ipc://{tmp_path}/flowing.sock")
        flowing.connect(f"ipc://{tmp_path}/flowing.sock")
        sent = _dispatch(20)
        send_staged(stuck, pool, lambda writer: codec.encode(_dispatch(21), tensor_writer=writer))
        send_staged(flowing, pool, lambda writer: codec.encode(sent, tensor_writer=writer))
        assert pull.poll(RECV_TIMEOUT_MS, zmq.POLLIN)
        _assert_same_dispatch(codec.decode(pull.recv_multipart(copy=False)), sent)
        started = time.monotonic()
        lease = pool.acquire()
        assert time.monotonic() - started < 1.0
        assert pool.num_in_flight == 1  # the stuck one
        lease.release_after(None)
    finally:
        for socket in (stuck, flowing, pull):
            socket.close(0)
        context.term()
