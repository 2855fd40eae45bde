"""`MoEDispatcher.start`'s one split sends exactly the Dispatches of the reference device-side split
(bench/hostwork_legacy.py) whether it runs on the host (CUDA IPC) or the device (ZeroMQ), the worker count is read
once per router version, and the quantized expert worker stays within its sync budget on CUDA: none per
Dispatch before its reply (host-tensor Dispatches) and one for device-tensor Dispatches (CUDA IPC)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import zmq

from moemesh.bench.hostwork import build_expert_worker, make_dispatch
from moemesh.bench.hostwork_attention import Drain, RecordingChannel
from moemesh.bench.hostwork_measure import SyncCounter
from moemesh.bench.hostwork_legacy import legacy_expert_stages, legacy_start_stages
from moemesh.common.wire.messages import ErrorCode, ErrorReply
from moemesh.services.attention.expert_channel import ExpertChannel
from moemesh.common.wire.cuda_ipc import DataPlane
from moemesh.services.attention.moe_dispatch import MoEDispatcher

NUM_EXPERTS = 256
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _sent_equal(new, old) -> bool:
    return len(new) == len(old) and all(
        a[0] == b[0] and all((p is None and q is None) or torch.equal(p, q) for p, q in zip(a[1], b[1]))
        for a, b in zip(new, old))


def _split_both_ways(tmp_path, device: torch.device, token_counts, data_plane: DataPlane = DataPlane.CUDA_IPC):
    """For each T and layer: (Dispatches start sent, Dispatches the legacy split sent, syncs counted during
    start, the ticket). CUDA IPC on the CPU: the host split runs and every worker falls back to ZeroMQ."""
    owner = [[(e * 7) % 3 % 2 for e in range(NUM_EXPERTS)], [e % 2 for e in range(NUM_EXPERTS)]]  # [L=2, E]
    endpoints = [f"ipc://{tmp_path}/w{i}.sock" for i in range(2)]
    context = zmq.Context()
    drain = Drain(context, endpoints)
    channel = RecordingChannel(ExpertChannel(endpoints, context=context))
    dispatcher = MoEDispatcher(channel, owner, placement_invariant=False, device=device, data_plane=data_plane)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = []
    try:
        for num_tokens in token_counts:
            generator = torch.Generator().manual_seed(num_tokens)
            x = torch.randn(num_tokens, 512, generator=generator).to(device=device, dtype=dtype)
            weights, ids = torch.rand(num_tokens, NUM_EXPERTS, generator=generator).to(device).topk(6, dim=1)
            for layer in (0, 1):
                channel.recording, channel.sent = True, []
                counter = SyncCounter(device)
                with counter:
                    pending = dispatcher.start(3, 0, layer, x, ids, weights)
                new, channel.sent = channel.sent, []
                legacy_start_stages(dispatcher, 3, layer, x, ids, weights, {})
                results.append((new, channel.sent, counter.count, pending))
                channel.recording = False
    finally:
        drain.close()
        channel.inner.close()
        context.term()
    return results


def test_host_split_sends_the_dispatches_of_the_device_split(tmp_path):
    results = _split_both_ways(tmp_path, torch.device("cpu"), [1, 5, 64])
    for new, old, _, pending in results:
        assert new and _sent_equal(new, old)
        assert sorted(s.worker_index for s in pending.sent) == [w for w, _ in new]
        for sent, (_, tensors) in zip(pending.sent, new):
            assert len(sent.token_index) == tensors[0].shape[0]  # finish adds the answer at these rows
            assert torch.equal(sent.slot_mask, tensors[3])


def test_zmq_split_sends_the_dispatches_of_the_device_split(tmp_path):
    for new, old, _, _ in _split_both_ways(tmp_path, torch.device("cpu"), [8], data_plane=DataPlane.ZMQ):
        assert new and _sent_equal(new, old)


def test_worker_count_is_read_once_per_router_version(tmp_path):
    """`router.num_workers` walks every holder list: start reads it again only after the router changed."""
    from moemesh.services.attention.replica_routing import ReplicaRouter

    calls = []

    class CountingRouter(ReplicaRouter):
        @property
        def num_workers(self) -> int:
            calls.append(1)
            return super().num_workers

    context = zmq.Context()
    channel = ExpertChannel([f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"], context=context)
    try:
        dispatcher = MoEDispatcher(channel, [[0, 1]], placement_invariant=False, device=torch.device("cpu"))
        dispatcher.slot_owners.set_router(CountingRouter([[(0,), (1,)]]))
        for _ in range(3):
            dispatcher._grow_counters()
    finally:
        channel.close()
        context.term()
    assert len(calls) == 1
    dispatcher.slot_owners.router.mark_down(1)  # a new version: read again
    dispatcher._grow_counters()
    assert len(calls) == 2 and len(dispatcher.num_slot_tokens_in_flight) == 2


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_cuda_quantized_worker_is_bit_identical_and_sync_free(num_tokens):
    generator = torch.Generator().manual_seed(0)
    held_experts = sorted(torch.randperm(NUM_EXPERTS, generator=generator)[:192].tolist())
    held = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
    held[held_experts] = True
    worker = build_expert_worker("cuda", 256, held_experts)
    for seed in range(3):
        dispatch = make_dispatch(num_tokens, held, torch.bfloat16, seed=seed)
        counter = SyncCounter(worker.device)
        with counter:
            reply = worker.handle_dispatch(dispatch)
        # host-tensor Dispatch (ZeroMQ): hidden rows, row layout and row weights go up by plain copies from
        # pageable memory (each a synchronous copy), then the reply's device-to-host copy
        assert counter.count <= 4
        expected = legacy_expert_stages(worker, dispatch, {})
        assert torch.equal(reply.output, expected)
        on_device = dataclasses.replace(dispatch, hidden=dispatch.hidden.cuda(), expert_ids=dispatch.expert_ids.cuda(),
                                        weights=dispatch.weights.cuda(), slot_mask=dispatch.slot_mask.cuda())
        counter = SyncCounter(worker.device)
        with counter:
            reply = worker.handle_dispatch(on_device)
        assert counter.count <= 2  # CUDA IPC views: one read-back of ids and mask, then the reply's copy
        assert torch.equal(reply.output, expected)
    refused = worker.handle_dispatch(make_dispatch(2, ~held, torch.bfloat16, seed=9))  # selects unheld experts
    assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.NOT_FOUND
