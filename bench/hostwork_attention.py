"""The attention side of the host-work benchmark (bench/hostwork.py): `MoEDispatcher.start` splitting a
layer's routing between two expert workers over real ZeroMQ sockets, drained by a child process
(`Drain`), against the device-side reference (bench/hostwork_legacy.py).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch

from moemesh.bench.timing import sync
from moemesh.bench.hostwork_measure import HIDDEN, NUM_EXPERTS, NUM_LAYERS, TOP_K, Samples, _tick, profile_calls

_DRAIN_CODE = """
import sys, zmq
context = zmq.Context()
poller = zmq.Poller()
for endpoint in sys.argv[1:]:
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(endpoint)
    poller.register(socket, zmq.POLLIN)
print("bound", flush=True)
while True:
    for socket, _ in poller.poll(1000):
        socket.recv_multipart(copy=False)
"""


class Drain:
    """ROUTER sockets at `endpoints` whose messages are received and dropped (the expert workers' end):
    by a thread (tests), or by a child process (timings: a draining thread would take the GIL from the
    timed thread at random)."""

    def __init__(self, context, endpoints: list[str], *, in_process: bool = True) -> None:
        import zmq

        self.sockets = []
        self._process = None
        self._stop = threading.Event()
        if not in_process:
            import subprocess

            self._process = subprocess.Popen([sys.executable, "-c", _DRAIN_CODE, *endpoints],
                                             stdout=subprocess.PIPE, text=True)
            if self._process.stdout.readline().strip() != "bound":
                raise RuntimeError("the drain process did not bind its sockets")
            return
        for endpoint in endpoints:
            socket = context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(endpoint)
            self.sockets.append(socket)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for socket in self.sockets:
            poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(20):
                socket.recv_multipart(copy=False)

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(5)
            return
        self._stop.set()
        self._thread.join(5)
        for socket in self.sockets:
            socket.close(linger=0)


class RecordingChannel:
    """Wraps an ExpertChannel; keeps host copies of what `send` was given while `recording`."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.recording = False
        self.sent: list[tuple[int, tuple]] = []
        self.send_s = 0.0  # host time inside the channel's send (encode, staging copies, ZeroMQ)

    def send(self, worker_index: int, message):
        if self.recording:
            self.sent.append((worker_index, tuple(None if t is None else t.detach().cpu().clone() for t in (
                message.hidden, message.expert_ids, message.weights, message.slot_mask))))
        began = time.perf_counter()
        ticket = self.inner.send(worker_index, message)
        self.send_s += time.perf_counter() - began
        return ticket

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _routing(num_tokens: int, device: torch.device, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(device=device, dtype=dtype)  # [T, D]
    scores = torch.rand(num_tokens, NUM_EXPERTS, generator=generator).to(device)  # [T, E]
    weights, ids = scores.topk(TOP_K, dim=1)  # [T, K]
    return x, ids, weights


def bench_start(device: torch.device, token_counts: list[int], iterations: int, run_dir: Path,
                profile_tokens: int | None = 8) -> dict:
    import zmq

    from moemesh.bench.hostwork_legacy import legacy_start_stages
    from moemesh.services.attention.expert_channel import ExpertChannel
    from moemesh.services.attention.moe_dispatch import MoEDispatcher

    generator = torch.Generator().manual_seed(2)
    near = set(torch.randperm(NUM_EXPERTS, generator=generator)[: NUM_EXPERTS * 3 // 4].tolist())
    owner_table = [[0 if e in near else 1 for e in range(NUM_EXPERTS)]] * NUM_LAYERS  # [L, E]: V4-Flash's 43
    endpoints = [f"ipc://{run_dir}/hostwork-{i}.sock" for i in range(2)]
    context = zmq.Context()
    drain = Drain(context, endpoints, in_process=False)
    channel = RecordingChannel(ExpertChannel(endpoints, context=context))
    dispatcher = MoEDispatcher(channel, owner_table, placement_invariant=False, device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = {}
    try:
        for num_tokens in token_counts:
            layers = [_routing(num_tokens, device, dtype, seed=10 * num_tokens + i) for i in range(4)]
            identical = True
            for x, ids, weights in layers:  # the same Dispatch tensors both ways (recorded; the tests assert it)
                channel.recording, channel.sent = True, []
                dispatcher.start(0, 0, 0, x, ids, weights)
                new, channel.sent = channel.sent, []
                legacy_start_stages(dispatcher, 0, 0, x, ids, weights, {})
                old, channel.recording = channel.sent, False
                identical &= len(new) == len(old) and all(
                    a[0] == b[0] and all(torch.equal(p, q) for p, q in zip(a[1], b[1])) for a, b in zip(new, old))
            if not identical:
                print(f"start T={num_tokens}: DISPATCHES DIFFER from the legacy split", flush=True)
            row = {"identical_to_before": identical}
            samples = {variant: Samples(device) for variant in ("before", "after")}
            for i in range(iterations + 5):  # variants interleaved: machine noise hits each alike
                x, ids, weights = layers[i % len(layers)]
                for variant, sample in samples.items():
                    stages: dict[str, float] = {}
                    sync(device)
                    with sample.counter:
                        began = time.perf_counter()
                        if variant == "before":
                            legacy_start_stages(dispatcher, i, 0, x, ids, weights, stages)
                        else:
                            channel.send_s = 0.0
                            pending = dispatcher.start(i, 0, 0, x, ids, weights)
                            stages["component_send"] = channel.send_s * 1e6
                            dispatcher.num_slot_tokens_in_flight = [0] * len(dispatcher.num_slot_tokens_in_flight)
                            del pending
                        _tick(stages, "total", began)
                    if variant == "after":  # the CUDA IPC split's host pieces, timed separately
                        began = time.perf_counter()
                        routing = dispatcher._routing_on_host(ids, weights)
                        began = _tick(stages, "ipc_routing_readback", began)
                        dispatcher.slot_owners.of_slots(0, routing.ids, dispatcher.num_slot_tokens_in_flight)
                        _tick(stages, "ipc_owner_split", began)
                    sample.add(stages, warm=i >= 5)
            row.update({variant: sample.summary() for variant, sample in samples.items()})
            if num_tokens == profile_tokens:  # API calls per layer, both ways
                x, ids, weights = layers[0]
                row["api_calls_before"] = profile_calls(device, lambda: legacy_start_stages(
                    dispatcher, 0, 0, x, ids, weights, {}))
                row["api_calls_after"] = profile_calls(device, lambda: dispatcher.start(0, 0, 0, x, ids, weights))
                dispatcher.num_slot_tokens_in_flight = [0] * len(dispatcher.num_slot_tokens_in_flight)
            results[str(num_tokens)] = row
    finally:
        drain.close()
        channel.inner.close()
        context.term()
    return results
