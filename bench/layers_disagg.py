"""Disaggregated decode for `bench layers --disaggregated`: the attention side here, the routed experts in
an expert worker process on the same device, through the real code paths.

The expert process (`python -m moemesh.bench.layers_disagg --serve-expert ENDPOINT ...`) is the real
`ExpertWorker` on the real service runner (ZeroMQ ROUTER, asyncio loop), holding the same random
routed experts as the in-process stack (`random_routed_experts` with the seed `random_model`
uses, so the weights are bit-identical) as a stacked `QuantizedRoutedExperts` (`holder`), so it
computes with the same grouped FP4 kernels. This process drives the real attention worker's
`ModelRunner` + `MoEDispatcher` + `ExpertChannel`, over ZeroMQ with pinned host staging
(`zmq`) or over shared device rings with a ZeroMQ doorbell (`cuda_ipc`).

Per batch size and data plane it times whole decode steps (host clock, device synchronised at
the end of each step; every step is rolled back so all run at the same position) with 1 and
with `--micro-batches` micro-batches (the ping-pong: micro-batch B's attention runs while A's
experts run), and the same `ModelRunner` with the experts called in-process (`LocalDispatcher`,
the in-process eager reference). The first step's output streams are compared with the
in-process ones (`identical` = bit-equal). Steps are eager here unless `graphs` segments are
used (bench/layers_graphs.py).
Legend: B sequences, T tokens, D hidden, K top-k.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moemesh.bench.timing import median, wall_s

_REPO_ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the expert process
def serve_expert(endpoint: str, layers: str, tiny: bool, device: str, seed: int, kernel_friendly: bool = False,
                 graph_buckets: tuple[int, ...] = ()) -> int:
    """Run the real ExpertWorker holding every routed expert of the stack (random, seed + 1)."""
    import torch

    from moemesh.common.model.config import NumericsConfig
    from moemesh.common.model.random_init import LAYER_KIND_NAMES, flash_config, random_routed_experts, tiny_flash_like_config
    from moemesh.common.runtime.service import ServiceConfig, run_service
    from moemesh.common.wire.messages import ServiceRole
    from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig

    kinds = [LAYER_KIND_NAMES[name.strip()] for name in layers.split(",") if name.strip()]
    config = tiny_flash_like_config(kinds, kernel_friendly=kernel_friendly) if tiny else flash_config(kinds)
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    dtype_name = "bfloat16" if torch_device.type == "cuda" else "float32"

    class RandomExpertWorker(ExpertWorker):
        async def load(self) -> None:  # random weights instead of a checkpoint
            with torch.no_grad():
                self.holdings.adopt(random_routed_experts(config, NumericsConfig(dtype=dtype_name), torch_device,
                                                          seed=seed + 1))
            self.allocate_staging()
            if graph_buckets and torch_device.type == "cuda":
                from moemesh.services.expert.graphs import ExpertGraphConfig, ExpertGraphs

                self.graphs = ExpertGraphs(self.holdings.experts, ExpertGraphConfig(graph_buckets), torch_device, self.dtype)

    worker = RandomExpertWorker(ExpertWorkerConfig(name="bench-expert", checkpoint_path="", device=device,
                                                   dtype=dtype_name, reply_buffer_bytes=64 << 20,
                                                   recv_slot_bytes=64 << 20), config)
    return run_service(worker, ServiceConfig(name="bench-expert", role=ServiceRole.EXPERT, endpoint=endpoint,
                                             supervisor_endpoint=None, device=device))


def start_expert_process(endpoint: str, layers: str, tiny: bool, device: str, seed: int,
                         kernel_friendly: bool = False, graph_buckets: tuple[int, ...] = ()) -> subprocess.Popen:
    command = [sys.executable, "-m", "moemesh.bench.layers_disagg", "--serve-expert", endpoint, "--layers", layers,
               "--device", device, "--seed", str(seed)] + (["--tiny"] if tiny else []) + (
               ["--kernel-friendly"] if kernel_friendly else []) + (
               ["--graph-buckets", ",".join(map(str, graph_buckets))] if graph_buckets else [])
    return subprocess.Popen(command, cwd=_REPO_ROOT)


def wait_until_serving(endpoint: str, context: Any, process: subprocess.Popen, timeout_s: float) -> None:
    from moemesh.common.wire.errors import ReplyTimeout
    from moemesh.common.wire.messages import Ping
    from moemesh.common.wire.transport import SyncClient

    deadline = time.monotonic() + timeout_s
    client = SyncClient(endpoint, context=context)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the expert process exited with {process.returncode}")
            try:
                client.request(Ping(nonce=1), timeout_s=2.0)
                return
            except ReplyTimeout:
                if time.monotonic() > deadline:
                    raise
    finally:
        client.close()


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


# ----------------------------------------------------------------------------- in-process reference
@dataclass
class _LocalTicket:
    layer: int
    routed: Any  # [T, D]


class LocalDispatcher:
    """The `MoEDispatcher` interface with the experts called in this process (the reference)."""

    def __init__(self, experts: Any) -> None:
        self.experts = experts

    def start(self, step_id: int, micro_batch: int, layer: int, x, ids, weights) -> _LocalTicket:
        return _LocalTicket(layer, self.experts(layer, x, ids, weights))

    def finish(self, ticket: _LocalTicket):
        return ticket.routed


class LocalGraphDispatcher(LocalDispatcher):
    """The in-process experts run as the expert worker runs them, CUDA graphs by token bucket
    (services/expert/graphs.py): the reference that isolates the cost of the process boundary."""

    def __init__(self, experts: Any, device, dtype, buckets: tuple[int, ...]) -> None:
        from moemesh.services.expert.graphs import ExpertGraphConfig, ExpertGraphs

        super().__init__(experts)
        self.graphs = ExpertGraphs(experts, ExpertGraphConfig(buckets), device, dtype)

    def start(self, step_id: int, micro_batch: int, layer: int, x, ids, weights) -> _LocalTicket:
        routed = self.graphs.run(layer, x, ids, weights, None, False)  # a static output: copy it
        return _LocalTicket(layer, self.experts(layer, x, ids, weights) if routed is None else routed.clone())


# ----------------------------------------------------------------------------- timing
def decode_inputs(states: list, token_ids, num_micro_batches: int) -> list:
    """[(token_ids [T_i], chunks_i)] for one decode step, sequences split into contiguous micro-batches."""
    from moemesh.common.model.batch import SequenceChunk
    from moemesh.services.attention.worker import split_micro_batches

    return [(token_ids[group.start:group.stop], [SequenceChunk(states[i], 1) for i in group])
            for group in split_micro_batches(len(states), num_micro_batches)]


def time_runner_steps(runner: Any, states: list, token_ids, num_micro_batches: int, num_steps: int,
                      device) -> tuple[float, list, dict]:
    """(median step seconds, first step's outputs [h per micro-batch], overlap stats) over num_steps
    decode steps after one warm-up, each rolled back."""
    samples = []
    first = None
    for rep in range(num_steps + 1):
        outputs = []
        elapsed = wall_s(lambda: outputs.extend(runner.forward(rep, decode_inputs(states, token_ids, num_micro_batches))),
                         device, repeats=1)[0]
        for state in states:
            state.rollback(1)
        if rep == 0:
            first = [h.clone() for h in outputs]
        else:
            samples.append(elapsed)
    stats = getattr(runner, "stats", None)
    overlap = {} if stats is None else {"overlapped_runs": stats.num_overlapped_runs, "layer_runs": stats.num_layer_runs,
                                        "wait_s": stats.wait_s}
    return median(samples), first, overlap


def compare_outputs(reference: list, candidate: list) -> dict:
    import torch

    identical = all(torch.equal(a, b) for a, b in zip(reference, candidate))
    max_abs = max(float((a.float() - b.float()).abs().max()) for a, b in zip(reference, candidate))
    return {"identical": identical, "max_abs_diff": max_abs}


def run_disaggregated(args: Any, side: Any, experts: Any, config: Any, device, dtype) -> dict:
    """Every batch size x micro-batch count x data plane (x graphs); returns the JSON section."""
    import zmq

    from moemesh.common.wire.cuda_ipc import CudaIpcConfig, DataPlane
    from moemesh.services.attention.expert_channel import ExpertChannel
    from moemesh.services.attention.model_runner import ModelRunner
    from moemesh.services.attention.moe_dispatch import MoEDispatcher

    buckets = tuple(getattr(args, "expert_graph_buckets", None) or ())
    section: dict = {"expert_process": "services.expert.worker.ExpertWorker (holder: QuantizedRoutedExperts)",
                     "expert_graph_buckets": list(buckets),
                     "timing": "host clock per step, device synchronised, median", "runs": []}
    owner = [[0] * config.n_routed_experts for _ in range(config.num_hidden_layers)]
    local_runner = ModelRunner(side, LocalDispatcher(experts))
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="moemesh-disagg-") as run_dir:
        endpoint = f"ipc://{run_dir}/expert.sock"
        expert_device = getattr(args, "expert_device", None) or str(device)
        section["expert_device"] = expert_device
        process = start_expert_process(endpoint, args.layers, args.tiny, expert_device, args.seed,
                                       graph_buckets=buckets)
        channels = []
        try:
            wait_until_serving(endpoint, context, process, timeout_s=600)
            runners = {}
            for plane in args.data_planes:
                channel = ExpertChannel([endpoint], context=context, timeout_s=120.0)
                channels.append(channel)
                dispatcher = MoEDispatcher(channel, owner, placement_invariant=False, device=device,
                                           data_plane=DataPlane(plane),
                                           cuda_ipc=CudaIpcConfig(max_tokens=max(args.batch), sync="flags"))
                runners[plane] = ModelRunner(side, dispatcher)
            for batch_size in args.batch:
                try:
                    section["runs"].extend(_time_batch(args, config, side, experts, local_runner, runners,
                                                       batch_size, device, dtype))
                except RuntimeError as error:  # keep what was measured; the JSON says what failed
                    section["error"] = f"batch {batch_size}: {type(error).__name__}: {error}"[:2000]
                    print(f"  disaggregated batch {batch_size} failed: {section['error'][:500]}", flush=True)
                    break
        finally:
            for channel in channels:
                channel.close()
            stop_process(process)
    context.term()
    return section


def _time_batch(args, config, side, experts, local_runner, runners: dict, batch_size: int, device,
                dtype) -> list[dict]:
    import torch

    from moemesh.bench.layers_timing import decode_states

    states = decode_states(config, batch_size, args.context, dtype, device, args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    token_ids = torch.randint(0, config.vocab_size, (batch_size,), generator=generator, device=device)
    rows = []
    with torch.inference_mode():
        for num_micro_batches in sorted({1, min(args.micro_batches, batch_size)}):
            local_s, reference, _ = time_runner_steps(local_runner, states, token_ids, num_micro_batches,
                                                      args.steps, device)
            for plane, runner in runners.items():
                runner.stats = type(runner.stats)()
                disagg_s, outputs, overlap = time_runner_steps(runner, states, token_ids, num_micro_batches,
                                                               args.steps, device)
                rows.append(_row(batch_size, plane, num_micro_batches, False, local_s, disagg_s, runner.dispatcher,
                                 overlap=overlap, **compare_outputs(reference, outputs)))
            if getattr(args, "graph_segments", False) and device.type == "cuda":
                rows.extend(_time_graphed(args, side, experts, runners, states, token_ids, num_micro_batches,
                                          batch_size, local_s))
    del states
    return rows


def _time_graphed(args, side, experts, runners: dict, states, token_ids, num_micro_batches: int, batch_size: int,
                  local_s: float) -> list[dict]:
    """The same steps with CUDA graphs of the attention segments (bench/layers_graphs.py)."""
    import torch

    from moemesh.bench.layers_graphs import SegmentGraphDecode, time_segment_graphs

    rows = []
    try:
        graphs = SegmentGraphDecode(side, states, token_ids, num_micro_batches, args.graph_steps, experts)
    except RuntimeError as error:  # a capture failure must not lose the eager figures
        print(f"  segment graph capture failed: {str(error)[:300]}", flush=True)
        return [{"batch_size": batch_size, "micro_batches": num_micro_batches, "graphs": True,
                 "graph_error": f"{type(error).__name__}: {error}"[:2000]}]
    dispatchers = {plane: runner.dispatcher for plane, runner in runners.items()}
    buckets = tuple(getattr(args, "expert_graph_buckets", None) or ())
    if buckets:  # the same segments with the experts' graphs in this process: no process boundary
        dispatchers = {"in_process": LocalGraphDispatcher(experts, graphs.device, side.dtype, buckets), **dispatchers}
    try:
        for plane, dispatcher in dispatchers.items():
            try:
                step_s = time_segment_graphs(graphs, dispatcher, args.steps)
            except RuntimeError as error:  # keep the other planes' figures
                print(f"  graphed {plane} B={batch_size} failed: {str(error)[:300]}", flush=True)
                rows.append({"batch_size": batch_size, "data_plane": plane, "micro_batches": num_micro_batches,
                             "graphs": True, "graph_error": f"{type(error).__name__}: {error}"[:2000]})
                continue
            rows.append(_row(batch_size, plane, num_micro_batches, True, local_s, step_s, dispatcher,
                             graph_steps=len(graphs.steps)))
    finally:
        for state in states:  # the captures advanced the states by the captured steps
            state.rollback(len(graphs.steps))
        del graphs
        torch.cuda.synchronize()
    return rows


def _row(batch_size: int, plane: str, num_micro_batches: int, graphs: bool, local_s: float, step_s: float,
         dispatcher: Any, **extra: Any) -> dict:
    row = {"batch_size": batch_size, "data_plane": plane, "micro_batches": num_micro_batches, "graphs": graphs,
           "in_process_eager_step_s": local_s, "disaggregated_step_s": step_s,
           "ratio_to_in_process_eager": step_s / local_s,
           "slot_dispatches": getattr(getattr(dispatcher, "slot_plane", None), "num_slot_dispatches", 0), **extra}
    print(f"  disaggregated {plane:>8} B={batch_size:<3} micro-batches={num_micro_batches} graphs={graphs!s:<5}: "
          f"{step_s * 1e3:8.2f} ms vs in-process eager {local_s * 1e3:8.2f} ms "
          f"({row['ratio_to_in_process_eager']:.2f}x), identical={row.get('identical', '-')}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    """Entry of the expert process (`--serve-expert`); the benchmark itself runs from bench.layers."""
    import argparse

    parser = argparse.ArgumentParser(prog="bench.layers_disagg")
    parser.add_argument("--serve-expert", required=True)
    parser.add_argument("--layers", default="csa,hca")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--kernel-friendly", action="store_true", help="tiny widths the Triton kernels take")
    parser.add_argument("--graph-buckets", default="", help="token buckets of the expert CUDA graphs (empty: eager)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    buckets = tuple(int(v) for v in args.graph_buckets.split(",") if v.strip())
    return serve_expert(args.serve_expert, args.layers, args.tiny, args.device, args.seed, args.kernel_friendly,
                        buckets)


if __name__ == "__main__":
    sys.exit(main())
