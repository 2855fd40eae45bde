"""Round-trip cost of one Dispatch/Combine, against a plain in-process call.

For T tokens of a [T, D] activation (D = 4096, bf16), K = 6 top-k ids and weights, measure:
- `call`:  the trivial expert op called in-process (no wire at all), the floor;
- `codec`: encode + decode of Dispatch and Combine in-process (no socket), the codec's share;
- `ipc`, `tcp`: a full round trip to an expert process on this host over ipc:// or tcp://
  loopback (SyncClient -> the service skeleton's loop -> trivial op -> Combine), tensors
  sent from staging buffers (pinned when CUDA is available).
- `cuda_ipc` (CUDA only): the same round trip with the tensors in shared device rings and only
  the control message (DispatchSlot / CombineSlot) over ipc:// (`common/wire/cuda_ipc.py`,
  the attention worker's `SlotPlane`), timed until the output is usable on the device.

The expert process runs `EchoExpert` on the real service skeleton (`ServiceRunner`); its
op is `output = hidden * sum_k(weights)`. Prints median and p90 per case in microseconds
and writes `bench/results/dispatch-<device>-<time>.json` with ratios to the in-process call.

    python -m moemesh.bench.dispatch                       # T = 1, 8, 64, 2048 on the CPU
    python -m moemesh.bench.dispatch --device cuda:0       # tensors on the GPU, pinned staging
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moemesh.bench.timing import median, percentile, sync, wall_s

DEFAULT_TOKENS = (1, 8, 64, 2048)
# iterations per token count: enough for a stable median in a few seconds per case
DEFAULT_ITERATIONS = {1: 2000, 8: 2000, 64: 1000, 2048: 60}


def expert_op(dispatch: Any) -> Any:
    """The trivial expert: output [T, D] = hidden [T, D] * sum_k weights [T, K]."""
    from moemesh.common.wire.messages import Combine

    scale = dispatch.weights.sum(-1, keepdim=True).to(dispatch.hidden.dtype)  # [T, 1]
    return Combine(
        dispatch_id=dispatch.dispatch_id, step_id=dispatch.step_id, layer=dispatch.layer,
        micro_batch=dispatch.micro_batch, output=dispatch.hidden * scale,
    )


def serve_expert(endpoint: str, device: str, use_staging: bool) -> int:
    """The expert process: the service skeleton with one handler."""
    from moemesh.common.runtime.service import Service, ServiceConfig, run_service
    from moemesh.common.wire.messages import Dispatch, ServiceRole
    from moemesh.common.wire.staging import RecvStagingRing, SendStagingPool, StagingConfig

    from moemesh.common.wire.messages import AttachCudaIpc, DispatchSlot
    from moemesh.services.expert.ipc_plane import ExpertSlotPlane

    class EchoExpert(Service):
        accepts = (Dispatch, AttachCudaIpc, DispatchSlot)

        async def load(self) -> None:
            self.ring = RecvStagingRing(device)
            self.slot_plane = ExpertSlotPlane(device, "bench-expert")

        async def handle(self, message: Any) -> Any:
            match message:
                case AttachCudaIpc():
                    return self.slot_plane.attach(message)
                case DispatchSlot():
                    inputs = self.slot_plane.inputs(message)
                    if not isinstance(inputs, tuple):
                        return inputs
                    hidden, ids, weights, _ = inputs
                    echo = expert_op(Dispatch(dispatch_id=message.dispatch_id, step_id=message.step_id,
                                              layer=message.layer, micro_batch=message.micro_batch, hidden=hidden,
                                              expert_ids=ids, weights=weights))
                    return self.slot_plane.reply(message, echo.output)
                case Dispatch() as dispatch:
                    on_device = Dispatch(
                        dispatch_id=dispatch.dispatch_id, step_id=dispatch.step_id, layer=dispatch.layer,
                        micro_batch=dispatch.micro_batch, hidden=self.ring.to_device(dispatch.hidden),
                        expert_ids=dispatch.expert_ids, weights=self.ring.to_device(dispatch.weights),
                    )
                    return expert_op(on_device)

    service = EchoExpert()
    if use_staging:  # replies leave from recycled (pinned on CUDA hosts) staging buffers
        service.reply_staging = SendStagingPool(StagingConfig(num_buffers=4, buffer_bytes=64 << 20))
    runner_config = ServiceConfig(name="bench-expert", role=ServiceRole.EXPERT, endpoint=endpoint,
                                  supervisor_endpoint=None, device=device)
    return run_service(service, runner_config)


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    return {"median_us": median(samples_s) * 1e6, "p90_us": percentile(samples_s, 0.9) * 1e6,
            "num_iterations": len(samples_s)}


def _make_dispatch(num_tokens: int, hidden_size: int, top_k: int, device: str) -> Any:
    import torch

    from moemesh.common.wire.messages import Dispatch

    generator = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(torch.bfloat16)  # [T, D]
    expert_ids = torch.randint(0, 256, (num_tokens, top_k), dtype=torch.int32, generator=generator)  # [T, K]
    weights = torch.rand(num_tokens, top_k, generator=generator)  # [T, K]
    return Dispatch(dispatch_id=0, step_id=0, layer=3, micro_batch=0, hidden=hidden.to(device),
                    expert_ids=expert_ids, weights=weights.to(device))


def _time_call(dispatch: Any, iterations: int, device: str) -> list[float]:
    return wall_s(lambda: expert_op(dispatch).output, device, repeats=iterations)


def _time_codec(dispatch: Any, ring: Any, iterations: int, device: str) -> list[float]:
    """Both messages through encode + decode and the host<->device copies, no socket."""
    import dataclasses

    from moemesh.common.wire import codec

    def round_trip() -> None:
        received = codec.decode(codec.encode(dispatch))
        on_device = dataclasses.replace(received, hidden=ring.to_device(received.hidden),
                                        weights=ring.to_device(received.weights))
        combine = codec.decode(codec.encode(expert_op(on_device)))
        ring.to_device(combine.output)

    return wall_s(round_trip, device, repeats=iterations)


def _time_socket(client: Any, pool: Any, ring: Any, dispatch: Any, iterations: int, device: str) -> list[float]:
    return wall_s(lambda: ring.to_device(client.request(dispatch, timeout_s=30, staging=pool).output), device,
                  repeats=iterations)


def _time_cuda_ipc(channel: Any, plane: Any, dispatch: Any, iterations: int) -> list[float]:
    """Round trips through the shared device rings: write slot, doorbell, CombineSlot, output usable."""

    def round_trip() -> None:
        ticket, slot = plane.try_send(0, dispatch_id=1, step_id=0, layer=dispatch.layer, micro_batch=0,
                                      x=dispatch.hidden, ids=dispatch.expert_ids, weights=dispatch.weights,
                                      slot_mask=None)
        reply = channel.receive(0, ticket)
        output = plane.output(0, slot, reply, dispatch_id=1, layer=dispatch.layer,
                              num_tokens=dispatch.hidden.shape[0])
        if isinstance(output, str):
            raise RuntimeError(output)
        output.sum()  # a use of the output on the device, ordered after the expert's event
        sync("cuda")
        plane.release(0, slot)

    return wall_s(round_trip, "cuda", repeats=iterations)


def _run_cuda_ipc(args: argparse.Namespace, context: Any, run_dir: str, dispatches: dict, raw: dict) -> None:
    import torch

    from moemesh.common.wire.cuda_ipc import CudaIpcConfig
    from moemesh.services.attention.dispatch_slots import SlotPlane
    from moemesh.services.attention.expert_channel import ExpertChannel

    endpoint = f"ipc://{run_dir}/expert-cuda-ipc.sock"
    expert = _start_expert(endpoint, args.device, args.staging, args.num_threads)
    channel = ExpertChannel([endpoint], context=context, timeout_s=30)
    try:
        from moemesh.common.wire.transport import SyncClient

        probe = SyncClient(endpoint, context=context)
        try:
            _wait_until_serving(probe, time.monotonic() + 60)
        finally:
            probe.close()
        plane = SlotPlane(channel, CudaIpcConfig(num_slots=2, max_tokens=max(dispatches)), torch.device(args.device),
                          placement_invariant=False)
        for num_tokens, dispatch in dispatches.items():
            import dataclasses

            iterations = max(5, int(DEFAULT_ITERATIONS.get(num_tokens, 100) * args.iteration_scale))
            dispatch = dataclasses.replace(dispatch, expert_ids=dispatch.expert_ids.to(args.device))  # all on device
            _time_cuda_ipc(channel, plane, dispatch, min(20, iterations))  # warm-up (and the attach)
            if plane.num_slot_dispatches == 0:
                raise RuntimeError("the expert refused the CUDA IPC rings (see attention.data_plane_fallback)")
            raw[str(num_tokens)]["cuda_ipc"] = _percentiles(_time_cuda_ipc(channel, plane, dispatch, iterations))
    finally:
        channel.close()
        expert.terminate()
        expert.wait(30)


def _start_expert(endpoint: str, device: str, use_staging: bool, num_threads: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "moemesh.bench.dispatch", "--serve-expert", endpoint, "--device", device,
               "--num-threads", str(num_threads)]
    if not use_staging:
        command.append("--no-staging")
    return subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1])


def _wait_until_serving(client: Any, deadline_s: float) -> None:
    from moemesh.common.wire.errors import ReplyTimeout
    from moemesh.common.wire.messages import Ping

    while True:
        try:
            client.request(Ping(nonce=1), timeout_s=10.0)
            return
        except ReplyTimeout:
            if time.monotonic() > deadline_s:
                raise


def run_benchmark(args: argparse.Namespace) -> tuple[dict, dict]:
    import zmq

    from moemesh.common.wire.staging import RecvStagingRing, SendStagingPool, StagingConfig
    from moemesh.common.wire.transport import SyncClient

    dispatches = {t: _make_dispatch(t, args.hidden, args.top_k, args.device) for t in args.tokens}
    max_bytes = max(t for t in args.tokens) * args.hidden * 2 + (1 << 20)
    pool = SendStagingPool(StagingConfig(num_buffers=4, buffer_bytes=max_bytes)) if args.staging else None
    ring = RecvStagingRing(args.device, num_slots=4, slot_bytes=max_bytes)
    raw: dict[str, dict[str, dict]] = {}
    for num_tokens, dispatch in dispatches.items():
        iterations = max(5, int(DEFAULT_ITERATIONS.get(num_tokens, 100) * args.iteration_scale))
        raw[str(num_tokens)] = {
            "call": _percentiles(_time_call(dispatch, iterations, args.device)),
            "codec": _percentiles(_time_codec(dispatch, ring, iterations, args.device)),
        }
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="moemesh-bench-") as run_dir:
        for transport in args.transports:
            if transport == "cuda_ipc":
                _run_cuda_ipc(args, context, run_dir, dispatches, raw)
                continue
            endpoint = f"ipc://{run_dir}/expert.sock" if transport == "ipc" else f"tcp://127.0.0.1:{args.tcp_port}"
            expert = _start_expert(endpoint, args.device, args.staging, args.num_threads)
            client = SyncClient(endpoint, context=context)
            try:
                _wait_until_serving(client, time.monotonic() + 60)
                for num_tokens, dispatch in dispatches.items():
                    iterations = max(5, int(DEFAULT_ITERATIONS.get(num_tokens, 100) * args.iteration_scale))
                    _time_socket(client, pool, ring, dispatch, min(20, iterations), args.device)  # warm-up
                    samples = _time_socket(client, pool, ring, dispatch, iterations, args.device)
                    raw[str(num_tokens)][transport] = _percentiles(samples)
            finally:
                client.close()
                expert.terminate()
                expert.wait(30)
    context.term()
    ratios = {
        tokens: {f"{case}_over_call": cases[case]["median_us"] / cases["call"]["median_us"]
                 for case in cases if case != "call"}
        for tokens, cases in raw.items()
    }
    return raw, ratios


def _print_table(raw: dict, args: argparse.Namespace) -> None:
    cases = ["call", "codec", *args.transports]
    print(f"Dispatch/Combine round trip, [T, {args.hidden}] bf16, top-k {args.top_k}, device {args.device}, "
          f"staging {'on' if args.staging else 'off'}; median / p90 in microseconds")
    print(f"{'T tokens':>9} | " + " | ".join(f"{case:>19}" for case in cases))
    for tokens, results in raw.items():
        cells = [f"{results[c]['median_us']:>9.1f} / {results[c]['p90_us']:>7.1f}" for c in cases]
        print(f"{tokens:>9} | " + " | ".join(cells))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.dispatch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=lambda text: [int(t) for t in text.split(",")], default=list(DEFAULT_TOKENS))
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transports", type=lambda text: text.split(","), default=["ipc", "tcp"])
    parser.add_argument("--tcp-port", type=int, default=5699)
    parser.add_argument("--iteration-scale", type=float, default=1.0, help="multiply the iteration counts")
    parser.add_argument("--no-staging", dest="staging", action="store_false", help="send from tensor memory")
    parser.add_argument("--no-write", dest="write", action="store_false", help="do not write a result file")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="torch threads per process (client and expert share the host's cores)")
    parser.add_argument("--out-dir", type=Path, default=None, help="where the result JSON goes")
    parser.add_argument("--serve-expert", metavar="ENDPOINT", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch

    torch.set_num_threads(args.num_threads)
    if args.serve_expert:
        return serve_expert(args.serve_expert, args.device, args.staging)
    raw, ratios = run_benchmark(args)
    _print_table(raw, args)
    if args.write:
        from moemesh.bench.results_io import write_result

        path = write_result("dispatch", raw, ratios, out_dir=args.out_dir)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
