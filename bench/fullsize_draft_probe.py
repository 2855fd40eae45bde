"""Where a full-size draft forward's time goes (`bench.fullsize_draft --probe`, CUDA only).

The forward the draft worker times (`block_hidden` + `base_logits`: the three stages and the
target's head) is run on the worker's own padded inputs (`DraftWorker._batch_inputs`, full
128-position rings) in two experiments that do not change the served code:
- kernel profile (torch.profiler): GPU kernels per forward, their summed device time, and the
  heaviest kernels, against the forward's wall time. Summed kernel time far below wall time means
  the forward is bound by launches and host work, not by the device;
- CUDA graph: the same forward captured once and replayed, median replay time against the eager
  median, and whether the replay reproduces the eager output bit for bit. What a captured drafter
  would gain; a capture failure is reported (with its message), not raised.
Each experiment is wrapped so that a failure is recorded and the benchmark's other figures survive.
Legend: A requests, G = γ slots, C context positions, D hidden, V vocab.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from moemesh.bench.timing import median, sync, wall_s
from moemesh.common.wire import messages as m


def _forward(drafter, batch):
    hidden = drafter.block_hidden(batch.main_x, batch.context_positions, batch.context_valid,
                                  batch.block_token_ids, batch.block_positions)  # [A, G, D]
    return drafter.base_logits(hidden)  # [A, G, V]


def _median_wall_s(fn, device, repeats: int) -> float:
    return median(wall_s(fn, device, repeats=repeats))


def probe_inputs(worker, loop, num_requests: int, features_message, draft_request, seed_position: int):
    """Full rings for `num_requests` fresh requests, then the worker's padded forward inputs."""
    drafter = worker.drafter
    width = len(drafter.dspark.target_layer_ids) * drafter.config.hidden_size
    generator = torch.Generator().manual_seed(1000 + num_requests)
    request_ids = [f"probe{num_requests}-r{i}" for i in range(num_requests)]
    fill = features_message(0, request_ids, 0, seed_position, width, torch.bfloat16, generator)
    assert loop.run_until_complete(worker.handle(fill)) == m.Ack()
    request = draft_request(0, request_ids, seed_position, 0.0, drafter.dspark.block_size)
    return request_ids, worker._batch_inputs(list(request.slots))


def kernel_profile(drafter, batch, device, num_forwards: int = 3, top: int = 12) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        _forward(drafter, batch)
        sync(device)
        wall_s = _median_wall_s(lambda: _forward(drafter, batch), device, num_forwards)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(num_forwards):
                _forward(drafter, batch)
            sync(device)
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            by_name[event.name].append(event.time_range.elapsed_us())
    total_us = sum(sum(v) for v in by_name.values())
    num_kernels = sum(len(v) for v in by_name.values())
    heaviest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {"wall_s": wall_s, "kernel_s_per_forward": total_us * 1e-6 / num_forwards,
            "kernels_per_forward": num_kernels / num_forwards,
            "top_kernels": [{"name": name[:120], "calls_per_forward": len(v) / num_forwards,
                             "us_per_forward": sum(v) / num_forwards} for name, v in heaviest]}


def graph_replay(drafter, batch, device, repeats: int) -> dict:
    with torch.no_grad():
        eager = _forward(drafter, batch)
        eager_s = _median_wall_s(lambda: _forward(drafter, batch), device, repeats)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                _forward(drafter, batch)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _forward(drafter, batch)
        graph.replay()
        sync(device)
        matches = bool(torch.equal(captured, eager))
        replay_s = _median_wall_s(graph.replay, device, repeats)
    return {"eager_s": eager_s, "replay_s": replay_s, "speedup": eager_s / replay_s, "replay_matches_eager": matches}


def run_probes(worker, loop, batches: list[int], repeats: int, features_message, draft_request,
               seed_position: int) -> list[dict]:
    """Both experiments for every batch size; prints one block per size. Meant for CUDA (on the CPU
    the profile finds no GPU kernels and the graph experiment records its failure)."""
    device = worker.device
    rows = []
    for num_requests in batches:
        request_ids, batch = probe_inputs(worker, loop, num_requests, features_message, draft_request, seed_position)
        row: dict = {"num_requests": num_requests}
        for key, experiment in (("profile", lambda: kernel_profile(worker.drafter, batch, device)),
                                ("graph", lambda: graph_replay(worker.drafter, batch, device, repeats))):
            try:
                row[key] = experiment()
            except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                row[key] = {"error": f"{type(error).__name__}: {error}"[:500]}
        loop.run_until_complete(worker.handle(m.DraftRequest(step_id=0, slots=(), finished_request_ids=tuple(request_ids))))
        rows.append(row)
        print_probe(row)
    return rows


def print_probe(row: dict) -> None:
    profile, graph = row["profile"], row["graph"]
    if "error" in profile:
        print(f"probe A={row['num_requests']}: profile failed: {profile['error']}")
    else:
        print(f"probe A={row['num_requests']}: forward wall {profile['wall_s'] * 1e3:.3f} ms, "
              f"{profile['kernels_per_forward']:.0f} kernels summing {profile['kernel_s_per_forward'] * 1e3:.3f} ms")
        for kernel in profile["top_kernels"][:8]:
            print(f"    {kernel['us_per_forward']:9.1f} us  x{kernel['calls_per_forward']:5.1f}  {kernel['name'][:90]}")
    if "error" in graph:
        print(f"    CUDA graph: failed: {graph['error']}")
    else:
        print(f"    CUDA graph: eager {graph['eager_s'] * 1e3:.3f} ms, replay {graph['replay_s'] * 1e3:.3f} ms "
              f"({graph['speedup']:.1f}x), replay == eager: {graph['replay_matches_eager']}")
