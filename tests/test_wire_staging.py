"""Staging pools: buffers are reused only after ZeroMQ finished sending them; exhaustion is
reported after a bounded wait, never papered over by allocating."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
import zmq
import zmq.asyncio

from moemesh.common.wire import codec
from moemesh.common.wire import messages as m
from moemesh.common.wire.errors import StagingExhausted
from moemesh.common.wire.staging import RecvStagingRing, SendStagingPool, StagingConfig, send_staged
from moemesh.common.wire.transport import AsyncServer, SyncClient

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


# ----------------------------------------------------------------------------- CUDA: copies still in flight
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
_BUSY_CYCLES = int(2e8)  # ~0.1 s of GPU clock queued on a stream before the tensors exist


def _junk_filled_pool(max_sync_copy_bytes: int = StagingConfig.max_sync_copy_bytes) -> SendStagingPool:
    pool = SendStagingPool(StagingConfig(num_buffers=1, buffer_bytes=1 << 20, pin_memory=True,
                                         max_sync_copy_bytes=max_sync_copy_bytes))
    pool.storages[0].fill_(0xAB)  # what a stale read would see
    return pool


def _dispatch_on(device: torch.device, num_tokens: int) -> tuple[m.Dispatch, m.Dispatch]:
    """(the message on `device`, produced behind a busy stream; the same message on the CPU)."""
    generator = torch.Generator().manual_seed(num_tokens)
    expected = m.Dispatch(dispatch_id=1, step_id=0, layer=0, micro_batch=0,
                          hidden=torch.randn(num_tokens, 1024, generator=generator).bfloat16(),  # [T, D]
                          expert_ids=torch.randint(0, 256, (num_tokens, 6), dtype=torch.int32, generator=generator),
                          weights=torch.rand(num_tokens, 6, generator=generator),  # [T, K]
                          slot_mask=torch.rand(num_tokens, 6, generator=generator) > 0.5)
    sources = {name: getattr(expected, name).to(device) for name in ("hidden", "expert_ids", "weights", "slot_mask")}
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        torch.cuda._sleep(_BUSY_CYCLES)
        produced = {name: tensor.clone() for name, tensor in sources.items()}  # written only after the sleep
    return dataclasses.replace(expected, **produced), expected


def _sent_and_received(outgoing) -> list:
    """The frames of a staged message after a trip through an inproc PAIR (bounded wait)."""
    context = zmq.Context()
    address = f"inproc://staging-{time.monotonic_ns()}"
    receiver, sender = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        receiver.bind(address)
        sender.connect(address)
        outgoing.send(sender)
        assert receiver.poll(5000, zmq.POLLIN)
        return [frame.bytes for frame in receiver.recv_multipart(copy=False)]
    finally:
        sender.close(0)
        receiver.close(0)
        context.term()


def _assert_same(received: m.Dispatch, expected: m.Dispatch) -> None:
    for name in ("hidden", "expert_ids", "weights", "slot_mask"):
        assert torch.equal(getattr(received, name), getattr(expected, name)), name


@cuda
@pytest.mark.parametrize("max_sync_copy_bytes", [StagingConfig.max_sync_copy_bytes, 0])
def test_inline_device_tensors_are_read_only_after_their_copy_landed(max_sync_copy_bytes):
    """ids, weights and mask of 4 tokens travel inside the header: the codec reads them as soon as
    the writer returns, while the stream is still busy.
    With max_sync_copy_bytes=0 (every copy asynchronous) the stale bytes must
    show: the control that this test sees the race at all."""
    pool = _junk_filled_pool(max_sync_copy_bytes)
    device = torch.device("cuda", torch.cuda.current_device())
    message, expected = _dispatch_on(device, num_tokens=4)
    outgoing = pool.stage(lambda writer: codec.encode(message, tensor_writer=writer))
    frames = _sent_and_received(outgoing)
    assert len(frames) == 2  # header (ids, weights, mask inline) + hidden
    received = codec.decode(frames)
    if max_sync_copy_bytes:
        _assert_same(received, expected)
    else:
        assert not torch.equal(received.expert_ids, expected.expert_ids)
        assert torch.equal(received.hidden, expected.hidden)  # a frame: read after seal


@cuda
@two_gpus
def test_seal_waits_for_copies_from_a_device_that_is_not_current():
    pool = _junk_filled_pool()
    torch.cuda.set_device(0)
    # 256 tokens: every tensor (hidden 512 KiB, ids, weights, mask 1.5 KiB and more) is copied asynchronously
    message, expected = _dispatch_on(torch.device("cuda", 1), num_tokens=256)
    outgoing = pool.stage(lambda writer: codec.encode(message, tensor_writer=writer))
    _assert_same(codec.decode(_sent_and_received(outgoing)), expected)


@cuda
@two_gpus
def test_recv_ring_reuses_a_slot_only_after_its_copy_to_another_device():
    torch.cuda.set_device(0)
    ring = RecvStagingRing("cuda:1", num_slots=1, slot_bytes=1 << 20)
    tensors = [torch.full((1 << 16,), float(i)) for i in range(3)]
    with torch.cuda.device(1):
        torch.cuda._sleep(_BUSY_CYCLES)  # the first copy waits behind this on cuda:1's stream
    on_device = [ring.to_device(t) for t in tensors]
    torch.cuda.synchronize(1)
    assert all(torch.equal(d.cpu(), t) for d, t in zip(on_device, tensors))
