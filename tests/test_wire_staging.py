"""Staging pools: buffers are reused only after ZeroMQ finished sending them; exhaustion is
reported after a bounded wait, never papered over by allocating."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq
import zmq.asyncio

from common.wire import codec
from common.wire import messages as m
from common.wire.errors import StagingExhausted
from common.wire.staging import RecvStagingRing, SendStagingPool, StagingConfig, send_staged
from common.wire.transport import AsyncServer, SyncClient

NUM_ROWS, HIDDEN = 64, 1024  # T, D: 256 KiB per f32 tensor, above ZeroMQ's copy threshold


def _combine(value: float) -> m.Combine:
    return m.Combine(dispatch_id=1, step_id=0, layer=0, micro_batch=0, output=torch.full((NUM_ROWS, HIDDEN), value))


def test_buffer_reused_only_after_send_completes(tmp_path):
    context = zmq.Context()
    address = f"ipc://{tmp_path}/staging.sock"
    push = context.socket(zmq.PUSH)
    push.connect(address)  # nobody bound yet: the frames stay queued, so the sends are not complete
    pool = SendStagingPool(StagingConfig(num_buffers=2, buffer_bytes=1 << 20, max_wait_s=0.2))
    assert not pool.is_pinned or torch.cuda.is_available()
    for value in (1.0, 2.0):
        send_staged(push, pool, lambda writer, v=value: codec.encode(_combine(v), tensor_writer=writer))
    assert pool.num_in_flight == 2 and pool.num_free == 0
    started = time.monotonic()
    with pytest.raises(StagingExhausted):
        pool.acquire()
    assert 0.15 < time.monotonic() - started < 2.0

    pull = context.socket(zmq.PULL)
    pull.bind(address)
    received = [codec.decode(pull.recv_multipart(copy=False)) for _ in range(2)]
    # the frames were sent from the staging buffers untouched while in flight
    assert [float(message.output[0, 0]) for message in received] == [1.0, 2.0]
    assert all(torch.equal(message.output, _combine(v).output) for message, v in zip(received, (1.0, 2.0)))

    lease = pool.acquire(max_wait_s=5.0)  # completion observed through the MessageTracker
    assert lease.index in (0, 1) and pool.num_leases == 3
    lease.release_after(None)
    # ZeroMQ's I/O thread marks the other send done a moment after delivery; wait for it, bounded
    deadline = time.monotonic() + 5.0
    while pool.num_free < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.num_free == 2
    for socket in (push, pull):
        socket.close(0)
    context.term()


def test_message_larger_than_a_buffer_is_refused_and_the_buffer_returned():
    pool = SendStagingPool(StagingConfig(num_buffers=1, buffer_bytes=1024, max_wait_s=0.1))
    lease = pool.acquire()
    with pytest.raises(Exception, match="staging bytes"):
        codec.encode(_combine(1.0), tensor_writer=lease.write)
    lease.release_after(None)
    assert pool.num_free == 1


def test_staged_request_and_reply_round_trip(tmp_path):
    """A Dispatch sent by the sync client from a staging buffer, answered by the async server
    from its own staging pool, many times over two buffers (so buffers are recycled)."""
    address = f"ipc://{tmp_path}/expert.sock"
    num_requests = 6

    async def serve(server, pool):
        for _ in range(num_requests):
            incoming = await server.recv()
            dispatch = incoming.message
            output = dispatch.hidden.float() * dispatch.weights.sum(-1, keepdim=True)  # [T, D]
            await server.reply(incoming, m.Combine(dispatch_id=dispatch.dispatch_id, step_id=0, layer=dispatch.layer,
                                                   micro_batch=0, output=output), staging=pool)

    import threading

    async_context = zmq.asyncio.Context()
    server = AsyncServer(address, context=async_context)
    server_pool = SendStagingPool(StagingConfig(num_buffers=2, buffer_bytes=1 << 20))
    thread = threading.Thread(target=lambda: asyncio.run(serve(server, server_pool)), daemon=True)
    thread.start()
    context = zmq.Context()
    client = SyncClient(address, context=context)
    client_pool = SendStagingPool(StagingConfig(num_buffers=2, buffer_bytes=1 << 20))
    for index in range(num_requests):
        hidden = torch.randn(NUM_ROWS, 256).to(torch.bfloat16)  # [T, D]
        weights = torch.rand(NUM_ROWS, 6)  # [T, K]
        dispatch = m.Dispatch(dispatch_id=index, step_id=0, layer=index, micro_batch=0, hidden=hidden,
                              expert_ids=torch.zeros(NUM_ROWS, 6, dtype=torch.int32), weights=weights)
        combine = client.request(dispatch, timeout_s=10, staging=client_pool)
        assert combine.dispatch_id == index and combine.layer == index
        torch.testing.assert_close(combine.output, hidden.float() * weights.sum(-1, keepdim=True))
    thread.join(10)
    assert client_pool.num_leases == num_requests and server_pool.num_leases == num_requests
    client.close()
    server.close()
    context.term()
    async_context.term()


def test_recv_ring_on_cpu_returns_the_tensor_on_its_device():
    ring = RecvStagingRing("cpu")
    tensor = torch.arange(6, dtype=torch.float32)
    assert torch.equal(ring.to_device(tensor), tensor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recv_ring_cuda_copies_through_pinned_slots():
    ring = RecvStagingRing("cuda:0", num_slots=2, slot_bytes=1 << 20)
    tensors = [torch.full((1024,), float(i)) for i in range(5)]
    on_device = [ring.to_device(t) for t in tensors]
    torch.cuda.synchronize()
    assert all(torch.equal(d.cpu(), t) for d, t in zip(on_device, tensors))
