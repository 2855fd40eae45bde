"""The attention <-> expert data path through staging buffers.

Real ExpertChannel / MoEDispatcher on the attention side, real ExpertWorkers (tiny FP8/FP4
checkpoint) answering from threads over real ipc sockets. Checks: outputs through the pools equal
the unstaged path and the in-process experts bit for bit; a buffer is reused only after ZeroMQ
released it; the steady path allocates nothing; received outputs go through the landing ring
(pinned + async on CUDA, the frame itself on the CPU).
"""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from moemesh.common.kernels.moe_layout import sum_slots_in_order
from moemesh.common.wire import codec
from moemesh.common.wire.errors import StagingExhausted
from moemesh.common.wire.messages import Dispatch
from moemesh.common.wire.staging import StagingConfig
from moemesh.common.wire.transport import unpack_envelope
from dispatch_support import ThreadedExpert, expert_worker, write_tiny_checkpoint
from moemesh.services.attention.expert_channel import ExpertChannel
from moemesh.services.attention.moe_dispatch import MoEDispatcher


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("staging_ckpt")
    config = write_tiny_checkpoint(path, seed=7)
    return path, config


@pytest.fixture(scope="module")
def experts(checkpoint, tmp_path_factory):
    """Two threaded expert workers, each holding every expert (the owner table decides)."""
    path, _ = checkpoint
    run_dir = tmp_path_factory.mktemp("staging_run")
    context = zmq.Context()
    servers = [ThreadedExpert(expert_worker(path, f"expert-{i}"), f"ipc://{run_dir}/expert-{i}.sock", context).start()
               for i in range(2)]
    yield servers
    for server in servers:
        server.stop()
    context.term()


def _reference_experts(checkpoint):
    """The in-process experts: the same ExpertWorker computation, called directly (no wire), its slot
    outputs added in slot order as the placement-invariant dispatcher adds them -> f(layer, x, ids, w) [T, D]."""
    path, _ = checkpoint
    worker = expert_worker(path, "reference")

    def compute(layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        reply = worker.handle_dispatch(Dispatch(dispatch_id=0, step_id=0, layer=layer, micro_batch=0, hidden=x,
                                                expert_ids=ids, weights=weights.float(), per_expert_outputs=True))
        return sum_slots_in_order(reply.output.float())  # [T, K, D] -> [T, D]

    return compute


def _inputs(config, num_tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, config.hidden_size, generator=generator)  # [T, D]
    scores = torch.rand(num_tokens, config.n_routed_experts, generator=generator)  # [T, E]
    ids = scores.topk(config.num_experts_per_tok, dim=1).indices.sort(dim=1).values  # [T, K] ascending
    weights = torch.rand(num_tokens, config.num_experts_per_tok, generator=generator)  # [T, K]
    return x, ids, weights


def _big_inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 512, generator=generator)  # [T, D] f32, 128 KiB
    ids = torch.randint(0, 8, (64, 2), generator=generator)  # [T, K]
    return x, ids, torch.rand(64, 2, generator=generator)


def _split_owner(config) -> list[list[int]]:
    return [[e % 2 for e in range(config.n_routed_experts)] for _ in range(config.num_hidden_layers)]  # [L, E]


def _run(dispatcher, config, rounds, seed=0):
    outputs = []
    for step in range(rounds):
        layer = step % config.num_hidden_layers
        x, ids, weights = _inputs(config, 1 + 7 * (step % 3), seed + step)
        pending = dispatcher.start(step, 0, layer, x, ids, weights)
        x.fill_(float("nan"))  # the sender's tensors may change as soon as start() returned
        outputs.append(dispatcher.finish(pending))
    return outputs


def test_staged_dispatch_equals_unstaged_and_in_process_bit_for_bit(checkpoint, experts):
    _, config = checkpoint
    reference = _reference_experts(checkpoint)
    context = zmq.Context()
    channels = [ExpertChannel([s.endpoint for s in experts], context=context, timeout_s=20.0),
                ExpertChannel([s.endpoint for s in experts], context=context, timeout_s=20.0, staging=None)]
    try:
        cpu = torch.device("cpu")
        staged = _run(MoEDispatcher(channels[0], _split_owner(config), placement_invariant=True, device=cpu),
                      config, rounds=6)
        # the unstaged channel sends the caller's own tensors: they must not change before the reply
        plain_dispatcher = MoEDispatcher(channels[1], _split_owner(config), placement_invariant=True, device=cpu)
        plain = []
        for step in range(6):
            x, ids, weights = _inputs(config, 1 + 7 * (step % 3), step)
            pending = plain_dispatcher.start(step, 0, step % config.num_hidden_layers, x, ids, weights)
            plain.append(plain_dispatcher.finish(pending))
        for step, (a, b) in enumerate(zip(staged, plain)):
            x, ids, weights = _inputs(config, 1 + 7 * (step % 3), step)
            expected = reference(step % config.num_hidden_layers, x, ids, weights)  # [T, D]
            assert torch.equal(a, b)
            assert torch.equal(a, expected)
        assert channels[0].staging.num_leases == channels[0].num_requests > 0
        assert channels[0].num_unstaged_sends == 0
        assert channels[1].staging is None
        assert all(server.num_staged_replies > 0 for server in experts)  # replies left from the expert's pool
    finally:
        for channel in channels:
            channel.close()
        context.term()


def test_steady_dispatch_path_allocates_no_buffers(checkpoint, experts):
    _, config = checkpoint
    context = zmq.Context()
    channel = ExpertChannel([s.endpoint for s in experts], context=context, timeout_s=20.0,
                            staging=StagingConfig(num_buffers=3, buffer_bytes=1 << 20))
    try:
        dispatcher = MoEDispatcher(channel, _split_owner(config), placement_invariant=False, device=torch.device("cpu"))
        pool = channel.staging
        _run(dispatcher, config, rounds=3)  # warm-up
        buffer_ptrs = [storage.data_ptr() for storage in pool.storages]
        leases_before, requests_before = pool.num_leases, channel.num_requests
        outputs = _run(dispatcher, config, rounds=24, seed=100)
        assert [storage.data_ptr() for storage in pool.storages] == buffer_ptrs  # the same buffers, no new ones
        assert len(pool.storages) == 3
        assert pool.num_leases - leases_before == channel.num_requests - requests_before >= 24
        assert channel.num_unstaged_sends == 0
        assert pool.num_free + pool.num_in_flight == 3
        assert not channel._in_flight  # staged sends keep no message alive after their reply
        assert all(bool(torch.isfinite(o).all()) for o in outputs)  # the NaN written after start() never went out
    finally:
        channel.close()
        context.term()


def test_a_buffer_is_reused_only_after_zeromq_released_it(checkpoint, tmp_path):
    """No peer yet: ZeroMQ holds the queued frames, so both buffers stay leased and a third send
    fails instead of overwriting them; once a peer binds and drains the queue they come back,
    and what arrives is what was sent (not what a later send wrote). Activations of 128 KiB:
    pyzmq copies frames under 64 KiB itself, which would release a buffer at once."""
    endpoint = f"ipc://{tmp_path}/late-peer.sock"
    context = zmq.Context()
    channel = ExpertChannel([endpoint], context=context, timeout_s=5.0,
                            staging=StagingConfig(num_buffers=2, buffer_bytes=1 << 20, max_wait_s=0.2))
    peer = None
    try:
        sent = []
        for step in range(2):
            x, ids, weights = _big_inputs(50 + step)
            message = Dispatch(dispatch_id=step, step_id=step, layer=0, micro_batch=0, hidden=x,
                               expert_ids=ids.to(torch.int32), weights=weights)
            channel.send(0, message)
            sent.append(x.clone())
            x.fill_(0.0)
        assert channel.staging.num_free == 0 and channel.staging.num_in_flight == 2
        x, ids, weights = _big_inputs(99)
        with pytest.raises(StagingExhausted):
            channel.send(0, Dispatch(dispatch_id=9, step_id=9, layer=0, micro_batch=0, hidden=x,
                                     expert_ids=ids.to(torch.int32), weights=weights))
        peer = context.socket(zmq.ROUTER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.bind(endpoint)
        received = []
        for _ in range(2):
            assert peer.poll(10_000, zmq.POLLIN)
            _, envelope, *frames = peer.recv_multipart()
            unpack_envelope(envelope)
            received.append(codec.decode(frames, accept=(Dispatch,)).hidden)
        for got, want in zip(received, sent):
            assert torch.equal(got, want)
        deadline = time.monotonic() + 5.0  # pyzmq's gc thread marks a send done a moment after delivery
        while channel.staging.num_free < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert channel.staging.num_free == 2  # released by ZeroMQ, back in the pool
    finally:
        if peer is not None:
            peer.close(linger=0)
        channel.close()
        context.term()


def test_received_outputs_go_through_the_landing_ring(checkpoint, experts):
    _, config = checkpoint
    context = zmq.Context()
    channel = ExpertChannel([s.endpoint for s in experts], context=context)
    try:
        dispatcher = MoEDispatcher(channel, _split_owner(config), placement_invariant=False, device=torch.device("cpu"),
                                   recv_slot_bytes=4096)
        frame = torch.arange(16, dtype=torch.float32)
        assert dispatcher._to_device(frame).data_ptr() == frame.data_ptr()  # CPU: the received frame as it is
        big = torch.zeros(2048, dtype=torch.float32)  # 8 KiB > one slot
        assert torch.equal(dispatcher._to_device(big), big) and dispatcher.num_unstaged_receives == 1
    finally:
        channel.close()
        context.term()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_receive_lands_in_a_pinned_slot_and_copies_asynchronously(checkpoint):
    _, config = checkpoint
    context = zmq.Context()
    channel = ExpertChannel([], context=context)
    try:
        dispatcher = MoEDispatcher(channel, _split_owner(config), placement_invariant=False,
                                   device=torch.device("cuda"), num_recv_slots=2, recv_slot_bytes=1 << 16)
        assert channel.staging.is_pinned and all(slot.is_pinned() for slot in dispatcher.recv_ring._slots)
        outputs = []
        for step in range(5):  # more than the slots: each slot is reused after its copy finished
            received = torch.full((4, 32), float(step))
            outputs.append(dispatcher._to_device(received))
        torch.cuda.synchronize()
        for step, output in enumerate(outputs):
            assert output.is_cuda and bool((output == step).all())
    finally:
        channel.close()
        context.term()
