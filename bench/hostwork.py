"""`moemesh bench hostwork [--device cuda:0] [--out-dir DIR]`: per-Dispatch host work of the services' paths,
against the device-side split as a reference.

A full-size decode step spends its time in per-layer host work, not in bytes. This
benchmark measures that work in isolation, at true width (hidden 4096, top-6 of 256 experts) with a
tiny expert intermediate size (`--intermediate`, default 256) so that compute does not hide it:
- expert side: the expert worker (`ExpertWorker`, holding 3/4 of one layer's
  experts, as the full-size "near" worker does) answering Dispatches that arrive as host tensors
  (ZeroMQ), including the reply's device->host copy into the worker's staging pool (what the
  service runner does before sending);
- attention side: `MoEDispatcher.start` splitting a layer's routing between two expert workers (3/4 and
  1/4 of the experts; tables of 43 layers) and sending both Dispatches over real ZeroMQ sockets
  (drained by a child process). Over ZeroMQ the split itself runs on the device (see
  `MoEDispatcher.start`); "after" reads the worker count once per placement version, and the
  host pieces of the CUDA IPC split (routing read-back, owner split) are timed as components.
Each is run as the services do it ("after" in the JSON) and as the device-side reference does it ("before":
`bench/hostwork_legacy.py`, kept only here), for T = 1, 8, 64 tokens. Both are checked to
give identical results (expert outputs bit for bit; the same Dispatch tensors) before anything is timed.
Figures: µs per Dispatch (expert side) or per layer (attention side, two Dispatches), medians over
`--iterations` after a warm-up with the variants interleaved (plus the mean total), split into stages by
host time (stages that synchronise include the wait); on CUDA also the number of synchronising calls
torch reports (`torch.cuda.set_sync_debug_mode`) per Dispatch / layer, the CUDA API calls per call at T = 8
(torch.profiler), and the expert worker with the full-size harness's extra timing synchronise
(`bench/fullsize_expert.py` synchronises after each Dispatch to time it) against without it.
Legend: T tokens, K top-k slots, D hidden, E routed experts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from moemesh.bench.timing import sync

from moemesh.bench.hostwork_attention import bench_start
from moemesh.bench.hostwork_measure import HIDDEN, NUM_EXPERTS, TOP_K, Samples, _tick, profile_calls


# ------------------------------------------------------------------------------------------- expert side
def random_held_experts(config, pairs, device, *, seed: int = 0):
    """A `QuantizedRoutedExperts` holding `pairs` with random bytes in the config's expert format (the
    in-memory stacks of `common.model.random_init`, each layer drawn whole, the held experts kept), for
    kernel-level checks of one expert holder; models are checkpoints (`bench.random_checkpoint`)."""
    from moemesh.common.model.config import NumericsConfig
    from moemesh.common.model.quantized_experts import QuantizedRoutedExperts
    from moemesh.common.model.random_init import random_routed_experts

    by_layer: dict[int, list[int]] = {}
    for layer, expert in sorted({(int(l), int(e)) for l, e in pairs}):
        by_layer.setdefault(layer, []).append(expert)
    full = random_routed_experts(config, NumericsConfig(), device, seed=seed, layers=sorted(by_layer))
    stacks = {}
    for layer, experts in by_layer.items():
        held = full._layers[layer]
        index = torch.tensor(experts, dtype=torch.long, device=held.w1.device)
        tensors = [getattr(held, name).index_select(0, index) for name in ("w1", "s1", "w2", "s2", "w3", "s3")]
        stacks[layer] = (experts, tensors)
    return QuantizedRoutedExperts.from_config(stacks, config)


def build_expert_worker(device: str, intermediate: int, held_experts: list[int]):
    """An ExpertWorker holding `held_experts` of layer 0 (random FP4 weights), staging allocated."""
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import flash_config
    from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig

    config = flash_config([AttentionKind.CSA], hidden_size=HIDDEN, moe_intermediate_size=intermediate,
                          n_routed_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    pairs = [(0, e) for e in held_experts]
    worker = ExpertWorker(ExpertWorkerConfig(name="hostwork", checkpoint_path="", device=device), config)
    worker.holdings.adopt(random_held_experts(config, pairs, device, seed=3))
    worker.allocate_staging()
    return worker


def make_dispatch(num_tokens: int, held: torch.Tensor, dtype: torch.dtype, seed: int):
    """A Dispatch as the attention side sends it over ZeroMQ (host tensors): every token has >= 1 held slot."""
    from moemesh.common.wire.messages import Dispatch

    generator = torch.Generator().manual_seed(seed)
    rows = []
    while len(rows) < num_tokens:
        row = torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K]
        if bool(held[row].any()):
            rows.append(row)
    ids = torch.stack(rows)  # [T, K]
    return Dispatch(dispatch_id=seed, step_id=seed, layer=0, micro_batch=0,
                    hidden=torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype),
                    expert_ids=ids.to(torch.int32), weights=torch.rand(num_tokens, TOP_K, generator=generator),
                    per_expert_outputs=False, slot_mask=held[ids])


def reply_copy(worker, output: torch.Tensor) -> None:
    """What the service runner does with a Combine: copy its output into a staging buffer (and wait)."""
    lease = worker._reply_pool.acquire()
    lease.write(output)
    lease.seal()
    lease.release_after(None)


def after_expert_stages(worker, dispatch, stages: dict[str, float]) -> torch.Tensor:
    """`ExpertWorker.handle_dispatch` piece by piece (the same calls, timed between them)."""
    from moemesh.common.kernels.moe_layout import sum_slots_in_order

    began = time.perf_counter()
    selection = worker._select(dispatch)
    began = _tick(stages, "select", began)
    hidden = worker._to_device(dispatch.hidden).to(worker.dtype)
    began = _tick(stages, "to_device", began)
    per_slot = worker._selected_outputs(dispatch.layer, hidden, dispatch.weights, selection)
    began = _tick(stages, "compute", began)
    output = sum_slots_in_order(per_slot)
    _tick(stages, "sum", began)
    return output


def bench_expert(device: torch.device, intermediate: int, token_counts: list[int], iterations: int,
                 profile_tokens: int | None = 8) -> dict:
    from moemesh.bench.hostwork_legacy import legacy_expert_stages

    generator = torch.Generator().manual_seed(1)
    held_experts = sorted(torch.randperm(NUM_EXPERTS, generator=generator)[: NUM_EXPERTS * 3 // 4].tolist())
    held = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
    held[held_experts] = True
    worker = build_expert_worker(str(device), intermediate, held_experts)
    dtype = worker.dtype
    results = {}
    for num_tokens in token_counts:
        dispatches = [make_dispatch(num_tokens, held, dtype, seed=100 * num_tokens + i) for i in range(4)]
        identical = True
        for dispatch in dispatches:  # identical outputs (recorded; the tests assert it)
            new = worker.handle_dispatch(dispatch).output
            identical &= torch.equal(new, legacy_expert_stages(worker, dispatch, {}))
        if not identical:
            print(f"expert T={num_tokens}: OUTPUTS DIFFER from the legacy path", flush=True)
        row = {"identical_to_before": identical}
        samples = {variant: Samples(device) for variant in ("before", "after", "after_timing_sync")}
        sync(device)
        for i in range(iterations + 5):  # variants interleaved: machine noise hits each alike
            dispatch = dispatches[i % len(dispatches)]
            for variant, sample in samples.items():
                stages: dict[str, float] = {}
                with sample.counter:
                    began = time.perf_counter()
                    if variant == "before":
                        output = legacy_expert_stages(worker, dispatch, stages)
                    else:
                        output = after_expert_stages(worker, dispatch, stages)
                    if variant == "after_timing_sync":
                        began_sync = time.perf_counter()
                        sync(device)
                        _tick(stages, "timing_sync", began_sync)
                    began_reply = time.perf_counter()
                    reply_copy(worker, output)
                    _tick(stages, "reply_copy", began_reply)
                    _tick(stages, "total", began)
                sample.add(stages, warm=i >= 5)
        row.update({variant: sample.summary() for variant, sample in samples.items()})
        # the worker's own entry point, end to end (must match "after" within noise)
        sync(device)
        began = time.perf_counter()
        for i in range(iterations):
            reply_copy(worker, worker.handle_dispatch(dispatches[i % len(dispatches)]).output)
        row["after_handle_dispatch_us"] = (time.perf_counter() - began) * 1e6 / iterations
        row["num_selected_slots"] = sum(int(d.slot_mask.sum()) for d in dispatches) / len(dispatches)
        if num_tokens == profile_tokens:  # API calls per Dispatch (reply copy included), both ways
            row["api_calls_before"] = profile_calls(device, lambda: reply_copy(
                worker, legacy_expert_stages(worker, dispatches[0], {})))
            row["api_calls_after"] = profile_calls(device, lambda: reply_copy(
                worker, worker.handle_dispatch(dispatches[0]).output))
        results[str(num_tokens)] = row
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", default="1,8,64", help="comma-separated T values")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--intermediate", type=int, default=256, help="expert intermediate size (tiny)")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp"), help="where the ipc sockets go")
    args = parser.parse_args(argv)

    from moemesh.bench.results_io import write_result

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    token_counts = [int(t) for t in args.tokens.split(",")]
    raw = {"device": str(device), "hidden": HIDDEN, "num_experts": NUM_EXPERTS, "top_k": TOP_K,
           "intermediate": args.intermediate, "iterations": args.iterations, "token_counts": token_counts,
           "expert": bench_expert(device, args.intermediate, token_counts, args.iterations),
           "start": bench_start(device, token_counts, args.iterations, args.run_dir)}
    ratios = {}
    for side in ("expert", "start"):
        for tokens, row in raw[side].items():
            print(f"{side} T={tokens}:")
            for variant in ("before", "after", "after_timing_sync"):
                if variant in row:
                    stages = "  ".join(f"{k} {v:.1f}" for k, v in row[variant].items())
                    print(f"  {variant:>17}: {stages}  (µs; syncs per call)")
            for key in ("api_calls_before", "api_calls_after"):
                if row.get(key):
                    print(f"  {key}: " + "  ".join(f"{k} {v:.1f}" for k, v in row[key].items()))
            ratios[f"{side}_T{tokens}_before_over_after"] = row["before"]["total"] / row["after"]["total"]
            print(f"  before / after: {ratios[f'{side}_T{tokens}_before_over_after']:.2f}x")
    path = write_result("hostwork", raw, ratios, out_dir=args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
