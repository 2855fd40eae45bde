"""Transport over real ipc:// and tcp:// sockets: round trips, explicit timeouts, late replies."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
import zmq.asyncio

from moemesh.common.wire import codec
from moemesh.common.wire import messages as m
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.transport import (
    AsyncClient, Kind, SyncClient, check_bind_endpoint, pack_envelope, unpack_envelope,
)
from wire_support import EchoServerThread, assert_same_message, sample_messages


@pytest.fixture(params=["ipc", "tcp"])
def endpoint(request, tmp_path):
    if request.param == "ipc":
        return f"ipc://{tmp_path}/echo.sock"
    return "tcp://127.0.0.1:*"


def test_every_message_round_trips_through_sync_client(endpoint):
    context = zmq.Context()
    with EchoServerThread(endpoint) as server:
        client = SyncClient(server.endpoint, context=context, default_timeout_s=5)
        try:
            for message in sample_messages():
                expected = m.Pong(nonce=message.nonce, name="echo") if isinstance(message, m.Ping) else message
                assert_same_message(client.request(message), expected)
        finally:
            client.close()
    context.term()


def test_async_client_overlapping_requests_and_notify(endpoint):
    async def scenario(server_endpoint):
        context = zmq.asyncio.Context()
        client = AsyncClient(server_endpoint, context=context, default_timeout_s=5)
        try:
            samples = [message for message in sample_messages() if not isinstance(message, m.Ping)]
            replies = await asyncio.gather(*(client.request(message) for message in samples))
            for reply, message in zip(replies, samples):
                assert_same_message(reply, message)
            pongs = await asyncio.gather(*(client.request(m.Ping(nonce=i)) for i in range(50)))
            assert [pong.nonce for pong in pongs] == list(range(50))  # matched by id, not by order
            await client.notify(m.Heartbeat(name="w", role=m.ServiceRole.EXPERT, state=m.ServiceState.READY, sequence=1))
            await client.request(m.Ping(nonce=0))  # the notify was queued before this request
        finally:
            await client.close()
            context.term()

    with EchoServerThread(endpoint) as server:
        asyncio.run(scenario(server.endpoint))
        assert [type(n) for n in server.notifications] == [m.Heartbeat]


def test_malformed_request_gets_error_reply_and_server_goes_on(tmp_path):
    context = zmq.Context()
    with EchoServerThread(f"ipc://{tmp_path}/echo.sock") as server:
        raw = context.socket(zmq.DEALER)
        raw.connect(server.endpoint)
        raw.send_multipart([pack_envelope(Kind.REQUEST, 77), b"\x93\xa4ping\x01\x80"])  # ping without nonce
        assert raw.poll(5000)
        reply = raw.recv_multipart()
        assert unpack_envelope(reply[0]) == (Kind.REPLY, 77)
        error = codec.decode(reply[1:])
        assert isinstance(error, m.ErrorReply) and error.code is m.ErrorCode.MALFORMED
        client = SyncClient(server.endpoint, context=context)
        assert client.request(m.Ping(nonce=1)).nonce == 1
        assert server.server.num_dropped == 1
        client.close()
        raw.close(0)
    context.term()


@pytest.mark.parametrize("peer", ["silent", "absent"])
def test_sync_request_to_unresponsive_peer_times_out_within_bound(tmp_path, peer):
    context = zmq.Context()
    address = f"ipc://{tmp_path}/silent.sock"
    silent = context.socket(zmq.ROUTER)
    if peer == "silent":
        silent.bind(address)  # receives, never answers
    client = SyncClient(address, context=context)
    started = time.monotonic()
    with pytest.raises(ReplyTimeout):
        client.request(m.Ping(nonce=1), timeout_s=0.3)
    assert 0.25 < time.monotonic() - started < 2.0
    client.close()
    silent.close(0)
    context.term()


def test_async_timeout_then_late_reply_is_dropped(tmp_path):
    """A reply arriving after its request timed out is dropped; the next request still
    gets its own reply, not the stale one."""
    address = f"ipc://{tmp_path}/slow.sock"
    sync_context = zmq.Context()
    slow = sync_context.socket(zmq.ROUTER)
    slow.bind(address)

    def answer_late():
        for delay_s in (0.6, 0.0):  # first answer after the client gave up, second at once
            frames = slow.recv_multipart()
            time.sleep(delay_s)
            request = codec.decode(frames[2:])
            kind, correlation_id = unpack_envelope(frames[1])
            reply = codec.encode(m.Pong(nonce=request.nonce))
            slow.send_multipart([frames[0], pack_envelope(Kind.REPLY, correlation_id), *reply])

    peer = threading.Thread(target=answer_late, daemon=True)
    peer.start()

    async def scenario():
        context = zmq.asyncio.Context()
        client = AsyncClient(address, context=context)
        started = time.monotonic()
        with pytest.raises(ReplyTimeout):
            await client.request(m.Ping(nonce=1), timeout_s=0.3)
        assert time.monotonic() - started < 1.0
        await asyncio.sleep(0.5)  # the stale reply arrives meanwhile
        assert (await client.request(m.Ping(nonce=2), timeout_s=5)).nonce == 2
        assert client.num_late_replies == 1
        await client.close()
        context.term()

    asyncio.run(scenario())
    peer.join(5)
    slow.close(0)
    sync_context.term()


def test_binding_beyond_loopback_is_refused():
    check_bind_endpoint("tcp://127.0.0.1:5000")
    check_bind_endpoint("ipc:///tmp/x.sock")
    with pytest.raises(ValueError, match="CURVE"):
        check_bind_endpoint("tcp://0.0.0.0:5000")
    with pytest.raises(ValueError, match="only ipc"):
        check_bind_endpoint("inproc://x")


def test_a_task_cancelled_while_its_client_closes_stays_cancelled(tmp_path):
    """A loop stopped while it reconnects (awaiting close()) must end: close() ends the reply
    reader's cancellation, never its caller's."""
    async def scenario():
        context = zmq.asyncio.Context()
        client = AsyncClient(f"ipc://{tmp_path}/nobody.sock", context=context)
        with pytest.raises(ReplyTimeout):  # starts the reply reader
            await client.request(m.Ping(nonce=1), timeout_s=0.05)
        closing = asyncio.create_task(client.close())
        await asyncio.sleep(0)  # closing now awaits the cancelled reader
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert client.socket.closed
        quiet = AsyncClient(f"ipc://{tmp_path}/nobody.sock", context=context)
        with pytest.raises(ReplyTimeout):
            await quiet.request(m.Ping(nonce=2), timeout_s=0.05)
        await quiet.close()  # the reader's own cancellation ends inside close()
        assert quiet.socket.closed
        context.term()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
