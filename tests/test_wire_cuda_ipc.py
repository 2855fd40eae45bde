"""The CUDA IPC data plane: ring layout and control logic on the CPU, outputs identical to ZeroMQ on CUDA.

CPU tests cover what needs no device: the slot layout (parts disjoint and aligned, views of the right
shapes), the expert side refusing a channel it cannot map (CPU device, another host) and the attention
side falling back to ZeroMQ with a log event, against a real expert worker process. CUDA tests (skipped
without a device) run the real ModelRunner against real expert worker processes over both data planes
and require bit-identical outputs, also with two workers splitting the experts (masked slots).
"""

from __future__ import annotations

import tempfile

import pytest
import structlog
import torch
import zmq

from moemesh.common.wire.cuda_ipc import CudaIpcConfig, DataPlane, RingLayout, host_identity, slot_views
from moemesh.common.wire.messages import AttachCudaIpc, SharedCudaBuffer

_has_cuda = torch.cuda.is_available()


def _layout(per_expert_outputs: bool = False) -> RingLayout:
    return RingLayout(num_slots=3, max_tokens=5, hidden_size=40, top_k=3, hidden_dtype="bf16",
                      per_expert_outputs=per_expert_outputs)


@pytest.mark.parametrize("per_expert_outputs", [False, True])
def test_slot_parts_are_disjoint_aligned_and_shaped(per_expert_outputs):
    layout = _layout(per_expert_outputs)
    dispatch = torch.zeros(layout.num_slots * layout.dispatch_slot_bytes, dtype=torch.uint8)
    combine = torch.zeros(layout.num_slots * layout.combine_slot_bytes, dtype=torch.uint8)
    spans = []
    for slot in range(layout.num_slots):
        offsets = layout.dispatch_offsets(slot)
        assert all(offset % 256 == 0 for offset in offsets)
        hidden, ids, weights, mask, output = slot_views(layout, dispatch, combine, slot, 4)
        assert hidden.shape == (4, 40) and hidden.dtype == torch.bfloat16
        assert ids.shape == (4, 3) and ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert mask.dtype == torch.bool
        assert output.shape == ((4, 3, 40) if per_expert_outputs else (4, 40))
        for part in (hidden, ids, weights, mask):
            start = part.data_ptr() - dispatch.data_ptr()
            spans.append((start, start + part.numel() * part.element_size()))
        # writing every part of this slot fills bytes no other slot's part uses
        hidden.fill_(1.0), ids.fill_(7), weights.fill_(0.5), mask.fill_(True), output.fill_(2.0)
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= dispatch.numel()
    full = slot_views(layout, dispatch, combine, layout.num_slots - 1, layout.max_tokens)
    assert full[4].data_ptr() + full[4].numel() * 2 <= combine.data_ptr() + combine.numel()


def test_slot_views_refuse_outside_the_ring():
    layout = _layout()
    dispatch = torch.zeros(layout.num_slots * layout.dispatch_slot_bytes, dtype=torch.uint8)
    combine = torch.zeros(layout.num_slots * layout.combine_slot_bytes, dtype=torch.uint8)
    for slot, tokens in ((3, 1), (0, 6), (0, 0)):
        with pytest.raises(ValueError):
            slot_views(layout, dispatch, combine, slot, tokens)


def _attach_message(host_id: str) -> AttachCudaIpc:
    fake = SharedCudaBuffer(device_index=0, handle=b"\0" * 64, storage_size_bytes=1024, storage_offset_bytes=0,
                            ref_counter_handle=b"/none", ref_counter_offset=0, event_handle=b"",
                            event_sync_required=False, tensor_offset=0, num_bytes=1024)
    return AttachCudaIpc(channel_id="test/0", host_id=host_id, num_slots=2, max_tokens=4, hidden_size=8, top_k=2,
                         hidden_dtype="bf16", per_expert_outputs=False, dispatch_region=fake,
                         combine_region=fake, dispatch_event_handles=(b"\0" * 64,) * 2)


def test_expert_side_refuses_cpu_devices_and_other_hosts():
    from moemesh.services.expert.ipc_plane import ExpertSlotPlane

    on_cpu = ExpertSlotPlane(torch.device("cpu")).attach(_attach_message(host_identity()))
    assert not on_cpu.accepted and "not CUDA" in on_cpu.reason
    # a CUDA device object needs no driver until the rings are mapped: the host check comes first
    elsewhere = ExpertSlotPlane(torch.device("cuda", 0)).attach(_attach_message("other-host/boot"))
    assert not elsewhere.accepted and "other-host" in elsewhere.reason
    assert host_identity() == host_identity() and "/" in host_identity()


class _RefusedRing:
    """Only what ExpertChannel.attach_cuda_ipc reads from a ring; its peer refuses before mapping."""

    channel_id = "test/0"

    def attach_message(self) -> AttachCudaIpc:
        return _attach_message(host_identity())

    def attached(self, handles) -> None:  # pragma: no cover - reached only if the peer accepted
        raise AssertionError("a CPU expert worker must refuse")


def test_attention_side_falls_back_to_zmq_against_a_cpu_expert_worker():
    from moemesh.bench.layers_disagg import start_expert_process, stop_process, wait_until_serving
    from moemesh.services.attention.expert_channel import ExpertChannel
    from moemesh.services.attention.dispatch_slots import SlotPlane

    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="moemesh-ipc-") as run_dir:
        endpoint = f"ipc://{run_dir}/expert.sock"
        process = start_expert_process(endpoint, "csa", True, "cpu", 0)
        try:
            wait_until_serving(endpoint, context, process, timeout_s=120)
            channel = ExpertChannel([endpoint], context=context, timeout_s=30)
            try:
                with structlog.testing.capture_logs() as logs:
                    assert channel.attach_cuda_ipc(0, _RefusedRing()) is False
                    plane = SlotPlane(channel, CudaIpcConfig(), torch.device("cpu"), placement_invariant=False)
                    x = torch.zeros(2, 8)
                    assert plane.try_send(0, dispatch_id=1, step_id=0, layer=0, micro_batch=0, x=x,
                                          ids=torch.zeros(2, 2, dtype=torch.long), weights=torch.ones(2, 2),
                                          slot_mask=None) is None
                events = [entry for entry in logs if entry["event"] == "attention.data_plane_fallback"]
                assert len(events) == 2 and "not CUDA" in events[0]["reason"]
            finally:
                channel.close()
        finally:
            stop_process(process)
    context.term()


# ----------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not _has_cuda, reason="needs a CUDA device")


def _run_all_planes(num_workers: int, batch_size: int, num_micro_batches: int, num_steps: int = 3):
    """Outputs of `num_steps` decode steps: in-process, ZeroMQ, CUDA IPC (each step rolled back)."""
    from moemesh.bench.layers_disagg import (LocalDispatcher, decode_inputs, start_expert_process, stop_process,
                                     wait_until_serving)
    from moemesh.bench.layers_timing import decode_states
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import random_model, tiny_flash_like_config
    from moemesh.services.attention.expert_channel import ExpertChannel
    from moemesh.services.attention.model_runner import ModelRunner
    from moemesh.services.attention.moe_dispatch import MoEDispatcher

    device = torch.device("cuda", torch.cuda.current_device())
    config = tiny_flash_like_config([AttentionKind.CSA, AttentionKind.HCA], kernel_friendly=True)
    side, experts = random_model(config, device, seed=0)
    states = decode_states(config, batch_size, 40, torch.bfloat16, device, seed=0)
    token_ids = torch.randint(0, config.vocab_size, (batch_size,), device=device)
    # worker w holds every expert, but gets experts e with e % num_workers == w
    owner = [[e % num_workers for e in range(config.n_routed_experts)] for _ in range(config.num_hidden_layers)]
    context = zmq.Context()
    outputs = {}
    slot_dispatches = 0
    with tempfile.TemporaryDirectory(prefix="moemesh-ipc-") as run_dir:
        endpoints = [f"ipc://{run_dir}/expert{w}.sock" for w in range(num_workers)]
        processes = [start_expert_process(e, "csa,hca", True, str(device), 0, kernel_friendly=True)
                     for e in endpoints]
        try:
            for endpoint, process in zip(endpoints, processes):
                wait_until_serving(endpoint, context, process, timeout_s=300)
            runners = {"local": (ModelRunner(side, LocalDispatcher(experts)), None)}
            for plane in (DataPlane.ZMQ, DataPlane.CUDA_IPC):
                channel = ExpertChannel(endpoints, context=context, timeout_s=60)
                dispatcher = MoEDispatcher(channel, owner, placement_invariant=False, device=device,
                                           data_plane=plane, cuda_ipc=CudaIpcConfig(num_slots=3, max_tokens=16))
                runners[str(plane)] = (ModelRunner(side, dispatcher), channel)
            with torch.inference_mode():
                for name, (runner, _) in runners.items():
                    outputs[name] = []
                    for step in range(num_steps):
                        hs = runner.forward(step, decode_inputs(states, token_ids, num_micro_batches))
                        torch.cuda.synchronize()
                        outputs[name].append([h.clone() for h in hs])
                        for state in states:
                            state.rollback(1)
            slot_dispatches = runners["cuda_ipc"][0].dispatcher.slot_plane.num_slot_dispatches
            for _, channel in runners.values():
                if channel is not None:
                    channel.close()
        finally:
            for process in processes:
                stop_process(process)
    context.term()
    return outputs, slot_dispatches


@cuda
@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_cuda_ipc_outputs_equal_zmq_and_in_process(num_micro_batches):
    outputs, slot_dispatches = _run_all_planes(num_workers=1, batch_size=4, num_micro_batches=num_micro_batches)
    assert slot_dispatches == 3 * 2 * num_micro_batches  # steps x layers x micro-batches, none fell back
    for step in range(3):
        for local, via_zmq, via_ipc in zip(outputs["local"][step], outputs["zmq"][step], outputs["cuda_ipc"][step]):
            assert torch.equal(via_zmq, local)
            assert torch.equal(via_ipc, local)


@cuda
def test_cuda_ipc_with_two_workers_splitting_the_experts_equals_zmq():
    outputs, slot_dispatches = _run_all_planes(num_workers=2, batch_size=5, num_micro_batches=2)
    assert slot_dispatches > 0
    for step in range(3):
        for via_zmq, via_ipc, local in zip(outputs["zmq"][step], outputs["cuda_ipc"][step], outputs["local"][step]):
            assert torch.equal(via_ipc, via_zmq)
            torch.testing.assert_close(via_ipc.float(), local.float(), atol=2e-2, rtol=2e-2)


@cuda
@pytest.mark.timeout(120)
def test_a_killed_expert_fails_the_step_cleanly_and_leaves_no_stream_waiting():
    """With flags the attention stream waits on the device for the expert's combine flag; a dead expert
    must surface as ExpertWorkerLost (bounded by the dispatch timeout) and its waits must be released."""
    import signal

    from moemesh.bench.layers_disagg import LocalDispatcher, decode_inputs, start_expert_process, stop_process, \
        wait_until_serving
    from moemesh.bench.layers_timing import decode_states
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import random_model, tiny_flash_like_config
    from moemesh.services.attention.expert_channel import ExpertChannel
    from moemesh.services.attention.model_runner import ModelRunner
    from moemesh.services.attention.dispatch_tickets import ExpertWorkerLost
    from moemesh.services.attention.moe_dispatch import MoEDispatcher

    device = torch.device("cuda", torch.cuda.current_device())
    config = tiny_flash_like_config([AttentionKind.CSA, AttentionKind.HCA], kernel_friendly=True)
    side, experts = random_model(config, device, seed=0)
    states = decode_states(config, 2, 40, torch.bfloat16, device, seed=0)
    token_ids = torch.randint(0, config.vocab_size, (2,), device=device)
    owner = [[0] * config.n_routed_experts for _ in range(config.num_hidden_layers)]
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="moemesh-ipc-") as run_dir:
        endpoint = f"ipc://{run_dir}/expert.sock"
        process = start_expert_process(endpoint, "csa,hca", True, str(device), 0, kernel_friendly=True)
        try:
            wait_until_serving(endpoint, context, process, timeout_s=300)
            channel = ExpertChannel([endpoint], context=context, timeout_s=5)
            dispatcher = MoEDispatcher(channel, owner, placement_invariant=False, device=device,
                                       data_plane=DataPlane.CUDA_IPC, cuda_ipc=CudaIpcConfig(max_tokens=8))
            runner = ModelRunner(side, dispatcher)
            with torch.inference_mode():
                good = runner.forward(0, decode_inputs(states, token_ids, 1))
                want = ModelRunner(side, LocalDispatcher(experts))
                for state in states:
                    state.rollback(1)
                reference = want.forward(0, decode_inputs(states, token_ids, 1))
                for state in states:
                    state.rollback(1)
                assert all(torch.equal(a, b) for a, b in zip(good, reference))
                print(f"ring sync: {dispatcher.slot_plane._rings[0].sync}")  # flags where the driver has them
                process.send_signal(signal.SIGKILL)
                process.wait(30)
                with pytest.raises(ExpertWorkerLost):
                    runner.forward(1, decode_inputs(states, token_ids, 1))
            torch.cuda.synchronize()  # returns: no stream is left waiting for the dead expert
            assert dispatcher.slot_plane.num_unconfirmed == 0 and 0 not in dispatcher.slot_plane._rings
            channel.close()
        finally:
            stop_process(process)
    context.term()


# ----------------------------------------------------------------------------- deferred confirmation (CPU)
class _HostRing:
    """A stand-in for the device ring (slots, sequences, unblock), so SlotPlane's control logic runs on
    the CPU against a real ZeroMQ peer."""

    channel_id = "test/0"

    def __init__(self, num_slots: int) -> None:
        from moemesh.common.wire.cuda_ipc import RingSync

        self.sync = RingSync.FLAGS
        self._free = list(range(num_slots))
        self.sequence = [0] * num_slots
        self.unblocked: list[int] = []

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= 8

    def peek_free(self):
        return self._free[0] if self._free else None

    def acquire(self):
        return self._free.pop(0)

    def write(self, slot, hidden, ids, weights, slot_mask) -> int:
        self.sequence[slot] += 1
        return self.sequence[slot]

    def output(self, slot: int, num_tokens: int) -> torch.Tensor:
        return torch.full((num_tokens, 4), float(slot))

    def unblock(self, slot: int) -> None:
        self.unblocked.append(slot)

    def release(self, slot: int) -> None:
        self._free.append(slot)


def _answering_peer(endpoint: str, context: zmq.Context, fail_dispatch_id: int, stop):
    """A ROUTER that answers DispatchSlot with CombineSlot, or ErrorReply for `fail_dispatch_id`."""
    from moemesh.common.wire import codec
    from moemesh.common.wire.messages import CombineSlot, ErrorCode, ErrorReply
    from moemesh.common.wire.transport import Kind, pack_envelope, unpack_envelope

    socket = context.socket(zmq.ROUTER)
    socket.bind(endpoint)
    try:
        while not stop.is_set():
            if not socket.poll(50):
                continue
            peer, envelope, *frames = socket.recv_multipart()
            _, correlation_id = unpack_envelope(envelope)
            message = codec.decode(frames)
            reply = (ErrorReply(code=ErrorCode.INTERNAL, message="boom") if message.dispatch_id == fail_dispatch_id
                     else CombineSlot(dispatch_id=message.dispatch_id, step_id=message.step_id, layer=message.layer,
                                      micro_batch=message.micro_batch, slot=message.slot,
                                      num_tokens=message.num_tokens, sequence=message.sequence))
            socket.send_multipart([peer, pack_envelope(Kind.REPLY, correlation_id), *codec.encode(reply)])
    finally:
        socket.close(linger=0)


def test_flag_ordered_replies_are_confirmed_at_reuse_and_a_failure_unblocks_and_raises():
    import threading

    from moemesh.services.attention.dispatch_slots import SlotPlane
    from moemesh.services.attention.expert_channel import ExpertChannel

    class Lost(RuntimeError):
        pass

    context = zmq.Context()
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="moemesh-slots-") as run_dir:
        endpoint = f"ipc://{run_dir}/peer.sock"
        peer = threading.Thread(target=_answering_peer, args=(endpoint, context, 3, stop), daemon=True)
        peer.start()
        channel = ExpertChannel([endpoint], context=context, timeout_s=10)
        try:
            plane = SlotPlane(channel, CudaIpcConfig(num_slots=2), torch.device("cpu"), placement_invariant=False,
                              on_lost=lambda worker, cause: Lost(f"{worker}: {cause}"))
            ring = _HostRing(2)
            plane._rings[0] = ring  # as if attached (attaching needs CUDA)
            x, ids, weights = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)

            def send(dispatch_id: int) -> tuple[int, int]:
                return plane.try_send(0, dispatch_id=dispatch_id, step_id=0, layer=dispatch_id, micro_batch=0,
                                      x=x, ids=ids, weights=weights, slot_mask=None)

            for dispatch_id in (1, 2):  # finish without waiting for the replies: they are confirmed later
                ticket, slot = send(dispatch_id)
                assert plane.defers(0)
                out = plane.deferred_output(0, slot, ticket, dispatch_id=dispatch_id, layer=dispatch_id, num_tokens=3)
                assert out.shape == (3, 4)
                plane.release(0, slot)
            assert plane.num_unconfirmed == 2
            ticket, slot = send(3)  # reuses slot 0: dispatch 1's reply is received and checked first
            assert slot == 0 and plane.num_unconfirmed == 1 and ring.sequence[0] == 2
            plane.deferred_output(0, slot, ticket, dispatch_id=3, layer=3, num_tokens=3)
            plane.release(0, slot)
            with pytest.raises(Lost, match="boom"):
                plane.confirm_all()  # dispatch 2 is fine, dispatch 3 failed on the expert
            assert ring.unblocked == [0]  # the stream waiting for dispatch 3's flag is released
            assert plane.num_unconfirmed == 0 and 0 not in plane._rings  # the next send offers a new ring
        finally:
            stop.set()
            peer.join(5)
            channel.close()
    context.term()


def test_the_attention_command_line_selects_the_data_plane():
    import argparse

    from moemesh.services.attention.main import add_attention_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_attention_arguments(parser)
    assert options_from_args(parser.parse_args([])).data_plane is None  # None: the deployment file's key
    assert options_from_args(parser.parse_args(["--data-plane", "cuda_ipc"])).data_plane == "cuda_ipc"
    with pytest.raises(SystemExit):
        parser.parse_args(["--data-plane", "nccl"])
