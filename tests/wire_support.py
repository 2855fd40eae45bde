"""Helpers for the wire and runtime tests: one sample of every message type, a message
comparison that understands tensors, and a small service run as a child process.

Run as a script, this module is that child: `python tests/wire_support.py ENDPOINT SUPERVISOR LOG_DIR`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

from moemesh.common.sampling_params import SamplingParams  # noqa: E402
from moemesh.common.wire import messages as m  # noqa: E402


def sample_messages() -> list[Any]:
    """One instance of every message type, with non-default values where it matters."""
    import torch

    generator = torch.Generator().manual_seed(0)
    num_tokens, top_k, hidden = 5, 6, 64  # T, K, D
    hidden_states = torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16)  # [T, D]
    expert_ids = torch.randint(0, 256, (num_tokens, top_k), dtype=torch.int32, generator=generator)  # [T, K]
    weights = torch.rand(num_tokens, top_k, generator=generator)  # [T, K] f32
    experts = (m.ExpertKey(layer=3, expert=17), m.ExpertKey(layer=42, expert=255))
    shared_buffer = m.SharedCudaBuffer(device_index=0, handle=b"\x02" * 64, storage_size_bytes=1 << 20,
                                       storage_offset_bytes=512, ref_counter_handle=b"/torch_123", ref_counter_offset=3,
                                       event_handle=b"", event_sync_required=False, tensor_offset=0,
                                       num_bytes=1 << 19)
    return [
        m.Register(name="expert-0", role=m.ServiceRole.EXPERT, pid=123, host="h1", device="cuda:1", endpoint="ipc:///tmp/e0"),
        m.Ready(name="attention-0", role=m.ServiceRole.ATTENTION, pid=7, endpoint="tcp://127.0.0.1:5601", device="cuda:0"),
        m.Heartbeat(name="draft", role=m.ServiceRole.DRAFT, state=m.ServiceState.DRAINING, sequence=9, num_inflight=2),
        m.Drain(reason="scale in"),
        m.Shutdown(reason="test"),
        m.Ping(nonce=2**40),
        m.Pong(nonce=3, name="x"),
        m.Ack(detail="ok"),
        m.ErrorReply(code=m.ErrorCode.OVERLOADED, message="busy", request_id="req-1"),
        m.StepPlan(
            step_id=11,
            sequences=(
                m.ScheduledSequence(
                    request_id="req-1", seq_slot=0, token_ids=(1, 2, 3, 4), start_position=0,
                    block_ids=((0, 1), (5,)), do_sample=True,
                    sampling=SamplingParams(temperature=0.7, top_k=20, stop_token_ids=(1, 2)).to_wire(),
                    draft_token_ids=(4,),
                ),
                m.ScheduledSequence(
                    request_id="req-2", seq_slot=3, token_ids=(9,), start_position=130,
                    block_ids=((2,), ()), do_sample=False, snapshot_targets=((1, 7),),
                ),
            ),
            swap_out=((4, 0), (7, 1)),
            swap_in=((2, 5),),
            snapshot_swap_out=((3, 0),),
            snapshot_swap_in=((1, 2),),
            free_seq_slots=(5, 6),
            prefix_restores=(m.PrefixRestore(request_id="req-3", seq_slot=4, block_ids=(8, 9), num_tokens=256,
                                              snapshot_id=3),),
        ),
        m.StepResult(
            step_id=11,
            sequences=(
                m.SequenceResult(
                    request_id="req-1", token_ids=(4, 77), num_draft_accepted=1,
                    logprobs=m.TokenLogprobs(logprobs=(-0.5, -1.25), top_token_ids=((4, 5), (77, 78)),
                                             top_logprobs=((-0.5, -1.0), (-1.25, -2.0))),
                ),
                m.SequenceResult(request_id="req-2", token_ids=(), error="slot lost"),
            ),
        ),
        m.DraftRequest(
            step_id=11,
            slots=(m.DraftSlot(request_id="req-1", num_draft_tokens=4, last_token_ids=(77,), start_position=6,
                               temperature=0.7, seed=5),),
            finished_request_ids=("req-9",),
        ),
        m.DraftTokens(
            step_id=11,
            proposals=(m.DraftProposal(request_id="req-1", token_ids=(1, 2), draft_probs=(0.5, 0.25),
                                       confidences=(0.9, 0.1)),),
        ),
        m.Dispatch(dispatch_id=1, step_id=11, layer=3, micro_batch=1, hidden=hidden_states,
                   expert_ids=expert_ids, weights=weights, per_expert_outputs=True),
        m.Combine(dispatch_id=1, step_id=11, layer=3, micro_batch=1,
                  output=torch.randn(num_tokens, top_k, hidden, generator=generator), per_expert_outputs=True),
        m.AttachCudaIpc(channel_id="attention-0/1", host_id="host/boot", num_slots=4, max_tokens=64,
                        hidden_size=hidden, top_k=top_k, hidden_dtype="bf16", per_expert_outputs=False,
                        dispatch_region=shared_buffer, combine_region=shared_buffer,
                        dispatch_event_handles=(b"\x01" * 64,) * 4),
        m.CudaIpcAttached(channel_id="attention-0/1", accepted=False, reason="other host"),
        m.AttachMailbox(channel_id="attention-0/1", host_id="host/boot", segment_path="/dev/shm/moemesh-mailbox-1",
                        owned_layers=(0, 0, 1), owned_experts=(2, 5, 7)),
        m.MailboxAttached(channel_id="attention-0/1", accepted=True, pid=4242),
        m.DispatchSlot(dispatch_id=2, step_id=11, layer=3, micro_batch=0, channel_id="attention-0/1", slot=1,
                       num_tokens=8, has_slot_mask=True),
        m.CombineSlot(dispatch_id=2, step_id=11, layer=3, micro_batch=0, slot=1, num_tokens=8),
        m.TargetFeatures(
            step_id=11,
            segments=(m.FeatureSegment(request_id="req-1", row_start=0, num_rows=2, start_position=4, token_ids=(4, 77)),),
            features=torch.randn(2, 3 * hidden, generator=generator).to(torch.float16),
        ),
        m.LoadExperts(placement_version=2, experts=experts, checkpoint_path="/models/x", dtype="bf16"),
        m.DropExperts(placement_version=3, experts=experts[:1]),
        m.QueryInventory(),
        m.ExpertInventory(name="expert-0", device="cuda:1", placement_version=2, experts=experts,
                          num_weight_bytes=10**10, memory_used_bytes=10**9, memory_total_bytes=None),
        m.MemoryReport(name="attention-0", device="cuda:0", memory_used_bytes=5, memory_total_bytes=10,
                       num_gpu_blocks=100, num_cpu_blocks=400),
        m.SwitchPlacement(placement_version=4, workers=(
            m.PlacementWorker(name="expert-1", endpoint="tcp://10.0.0.2:7001", experts=experts, replicas=experts[:1]),)),
        m.WriteRoutingStats(path="/var/lib/moemesh/stats.csv"),
        m.EndWarmUp(),
        m.WarmUpEnded(num_graph_captures=14, num_graph_steps=40, num_eager_steps=31),
        m.RoutingStatsWritten(paths=("/tmp/stats.csv", "/tmp/stats.decode.csv"), summary=m.RoutingSummary(
            num_steps=9, layers=(m.LayerRoutingSkew(layer=2, phase=m.RoutingPhase.DECODE, num_activations=60,
                                                    max_over_mean=2.5, top8_share=0.75, effective_experts=5.5,
                                                    num_unused=1),))),
    ]


def assert_same_message(actual: Any, expected: Any) -> None:
    """Field-by-field equality; tensors compared by dtype, shape and exact values."""
    import torch

    assert type(actual) is type(expected)
    for spec in dataclasses.fields(expected):
        got, want = getattr(actual, spec.name), getattr(expected, spec.name)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape, spec.name
            assert torch.equal(got, want), spec.name
        else:
            assert got == want, spec.name


def _child_main(endpoint: str, supervisor: str, log_dir: str) -> int:
    from moemesh.common.runtime.logging import configure_logging
    from moemesh.common.runtime.service import Service, ServiceConfig, run_service

    class _SlowEcho(Service):
        """Answers DraftRequest(step_id=N) with DraftTokens(step_id=N) after N milliseconds,
        so a test can put a request in flight before it sends SIGTERM."""

        accepts = (m.DraftRequest,)

        async def handle(self, message: Any) -> Any:
            match message:
                case m.DraftRequest(step_id=delay_ms):
                    await asyncio.sleep(delay_ms / 1000)
                    return m.DraftTokens(step_id=delay_ms, proposals=())

    configure_logging("slow-echo", log_dir, "info")
    config = ServiceConfig(name="slow-echo", role=m.ServiceRole.DRAFT, endpoint=endpoint,
                           supervisor_endpoint=supervisor, heartbeat_interval_s=0.1)
    return run_service(_SlowEcho(), config)


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:4]))


class EchoServerThread:
    """A real AsyncServer on its own thread and event loop: answers Ping with Pong and any
    other request with the message itself; records notifications. Use as a context manager."""

    def __init__(self, endpoint: str) -> None:
        import threading

        self.requested_endpoint = endpoint
        self.endpoint = ""
        self.notifications: list[Any] = []
        self.num_handled = 0
        self.server = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def __enter__(self) -> "EchoServerThread":
        self._thread.start()
        assert self._started.wait(10), "server thread did not start"
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        import zmq.asyncio

        from moemesh.common.wire.transport import AsyncServer

        context = zmq.asyncio.Context()
        self.server = AsyncServer(self.requested_endpoint, context=context)
        self.endpoint = self.server.endpoint
        self._task = asyncio.current_task()
        self._started.set()
        try:
            while True:
                incoming = await self.server.recv()
                self.num_handled += 1
                match incoming.message:
                    case m.Ping(nonce=nonce):
                        reply = m.Pong(nonce=nonce, name="echo")
                    case message:
                        reply = message
                if incoming.expects_reply:
                    await self.server.reply(incoming, reply)
                else:
                    self.notifications.append(incoming.message)
        except asyncio.CancelledError:
            pass
        finally:
            self.server.close()
            context.term()
