"""The DSpark drafter alone at V4-Flash size on one device: `propose` and `add_features` timings
against the drafter's weight-bandwidth floor.

Loads a checkpoint with random weights (`bench.random_checkpoint`: V4-Flash with its three DSpark
stages, three main layers for the target-layer features, written once and cached; `--tiny` for a CPU
rehearsal; `--checkpoint DIR` for any other) through the draft worker's own `load_drafter`, so the
drafter is exactly what `moemesh draft` serves. The timed calls are the worker's own
`handle(TargetFeatures)` and `handle(DraftRequest)` (in process, no sockets), fixed width γ = 5:
- rings: each of A requests gets 128 positions of target features (the full ring), as bf16 host
  tensors like the attention worker sends; `add_features` is then timed for A requests × k new
  rows (k = 1 and 5: a step that commits one token, or a whole accepted block);
- propose: one DraftRequest of A slots (seed at position 128, so every ring is full), greedy
  (temperature 0) and sampled (temperature 1), median of `--repeats` after `--warmup`; the
  worker's own split (stages + head forward vs chains) comes with it.

Floor: the bytes of the weights one proposal must read, over the device's copy bandwidth measured
in this run (`bench.layers_timing.measure_ceilings`, as bench/layers_floors.py uses): per stage
every own tensor except the feature fusion (main_proj/main_norm, read by add_features) and the
last-stage heads; the routed experts actually selected in that proposal (distinct per stage,
counted in an untimed recording pass; the uniform-routing expectation E·(1 − (1 − k/E)^(A·γ)) is
reported beside it); the target's head [V, D] plus the last norm and hc_head; the Markov W2 [V, r]
once per slot (the chain runs slot by slot). The embed and W1 rows are gathers (negligible).
add_features' floor is main_proj + main_norm. Activations and the context ring are not counted.
Legend: A requests, G = γ slots, V vocab, r Markov rank, D hidden, E routed experts, k top-k.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from pathlib import Path

from moemesh.bench.timing import floor_ratio, floor_s, median, sync, wall_s

CONTEXT_POSITIONS = 128
FEATURE_STEP_ROWS = (1, 5)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m moemesh.bench.fullsize_draft", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batches", default="1,8,64", help="requests per proposal (comma-separated)")
    parser.add_argument("--temperatures", default="0,1", help="0: greedy chains, > 0: sampled (support 64)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routing-skew", type=float, default=0.0)
    parser.add_argument("--probe", action="store_true",
                        help="CUDA: kernel profile and CUDA-graph replay of the forward (bench/fullsize_draft_probe.py)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same structure (CPU rehearsal)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint with DSpark stages (default: write one with random weights, cached)")
    parser.add_argument("--checkpoint-cache", type=Path, default=None,
                        help="where written checkpoints are kept (default $MOEMESH_CHECKPOINT_CACHE or "
                        "~/.cache/moemesh/checkpoints)")
    parser.add_argument("--out-dir", type=Path, default=None)
    return parser.parse_args(argv)


def hub_config(tiny: bool) -> dict:
    """V4-Flash (or the tiny preset) with the DSpark stages; three main layers, the fewest the drafter's
    target features need (the stages' shapes do not depend on the depth)."""
    from moemesh.bench.random_checkpoint import hub_config as checkpoint_hub_config

    return checkpoint_hub_config("tiny" if tiny else "v4-flash", num_layers=3 if not tiny else 4, dspark=True)


def drafter_weight_bytes(drafter) -> dict[str, int]:
    """Bytes the built drafter holds, by kind: fp8_linear_bytes (FP8 weights + scales), routed_expert_bytes
    (every stage's routed experts as held), other_bytes (its remaining own tensors), shared_bytes (the
    target's embed + head it holds a copy of); own_bytes and total_bytes."""
    from moemesh.common.model.quantized import Fp8Linear

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    own = {id(t): t for t in list(drafter.mtp.parameters()) + list(drafter.mtp.buffers())}
    fp8_tensors = {id(t): t for m in drafter.mtp.modules() if isinstance(m, Fp8Linear) for t in (m.weight, m.scale)}
    fp8 = nbytes(fp8_tensors.values())
    experts = drafter.experts_fn
    held = getattr(experts, "_layers", None)
    if held is not None:  # QuantizedRoutedExperts: per-layer stacks
        routed = sum(experts.bytes_per_expert(layer) * len(stack.expert_ids) for layer, stack in held.items())
    else:  # RoutedExperts: one (w1, w2, w3) per pair
        routed = nbytes(t for weights in experts._weights.values() for t in weights)
    other = nbytes(t for key, t in own.items() if key not in fp8_tensors)
    shared = nbytes(list(drafter.embed.parameters()) + list(drafter.head.parameters()))
    return {"fp8_linear_bytes": fp8, "routed_expert_bytes": routed, "other_bytes": other, "shared_bytes": shared,
            "own_bytes": fp8 + routed + other, "total_bytes": fp8 + routed + other + shared}


# ------------------------------------------------------------------------------------ floors
def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _module_bytes(module) -> int:
    return _tensor_bytes(list(module.parameters()) + list(module.buffers()))


def weight_groups(drafter) -> dict[str, int]:
    """Bytes of the weight groups the floors are built from (see the module)."""
    last = drafter.mtp[-1]
    first = drafter.mtp[0]
    fusion = _module_bytes(first.main_proj) + _module_bytes(first.main_norm)
    heads = _module_bytes(last.markov_head) + _module_bytes(last.confidence_head)
    last_head = _module_bytes(last.norm) + _tensor_bytes((last.hc_head_fn, last.hc_head_base, last.hc_head_scale))
    stages = sum(_module_bytes(block) for block in drafter.mtp) - fusion - heads - last_head
    return {"stages_bytes": stages, "fusion_bytes": fusion, "head_bytes": _module_bytes(drafter.head) + last_head,
            "markov_w2_bytes": _module_bytes(last.markov_head.markov_w2), "heads_bytes": heads}


def expected_distinct(num_experts: int, top_k: int, num_tokens: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


class RecordingExperts:
    """Wraps the drafter's ExpertsFn: records the distinct experts each stage selects (one untimed pass)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.distinct: dict[int, int] = {}

    def __call__(self, stage, hidden, ids, weights):
        self.distinct[stage] = int(ids.unique().numel())
        return self.inner(stage, hidden, ids, weights)


# ------------------------------------------------------------------------------------ timing
def _median_s(fn, device, warmup: int, repeats: int) -> tuple[float, list[float]]:
    """Median and samples of host-clock seconds per call, the device synchronised around each."""
    samples = wall_s(fn, device, warmup=warmup, repeats=repeats)
    return median(samples), samples


def features_message(step_id: int, request_ids: list[str], start_position: int, num_rows: int, width: int,
                      dtype, generator):
    import torch

    from moemesh.common.wire import messages as m

    features = torch.randn(len(request_ids) * num_rows, width, generator=generator).to(dtype)  # [A·n, F] host
    segments = tuple(m.FeatureSegment(rid, index * num_rows, num_rows, start_position,
                                      tuple(range(start_position, start_position + num_rows)))
                     for index, rid in enumerate(request_ids))
    return m.TargetFeatures(step_id=step_id, segments=segments, features=features)


def draft_request(step_id: int, request_ids: list[str], seed_position: int, temperature: float, block_size: int):
    from moemesh.common.wire import messages as m

    slots = tuple(m.DraftSlot(rid, num_draft_tokens=block_size, last_token_ids=(11 + index,),
                              start_position=seed_position, temperature=temperature,
                              seed=index if temperature > 0 else None,
                              first_output_position=0 if temperature > 0 else None)
                  for index, rid in enumerate(request_ids))
    return m.DraftRequest(step_id=step_id, slots=slots)


def time_batch(worker, loop, num_requests: int, temperatures: list[float], args, ceilings: dict,
               groups: dict) -> dict:
    """add_features and propose figures for one batch size (see the module)."""
    import torch

    from moemesh.common.wire import messages as m

    drafter, device = worker.drafter, worker.device
    config = drafter.config
    block_size = drafter.dspark.block_size
    width = len(drafter.dspark.target_layer_ids) * config.hidden_size
    feature_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(args.seed + num_requests)
    request_ids = [f"b{num_requests}-r{i}" for i in range(num_requests)]
    run = loop.run_until_complete
    fill = features_message(0, request_ids, 0, CONTEXT_POSITIONS, width, feature_dtype, generator)
    assert run(worker.handle(fill)) == m.Ack()
    row = {"num_requests": num_requests, "context_positions": CONTEXT_POSITIONS, "add_features": {}, "propose": {}}
    bw = ceilings["copy_bytes_per_s"]
    for num_rows in FEATURE_STEP_ROWS:  # rows land at 128.. and are cut back by the next propose's truncate
        message = features_message(1, request_ids, CONTEXT_POSITIONS, num_rows, width, feature_dtype, generator)
        call_s, samples = _median_s(lambda: run(worker.handle(message)), device, args.warmup, args.repeats)
        fusion_floor_s = floor_s(groups["fusion_bytes"], bw)
        row["add_features"][f"rows_{num_rows}"] = {
            "median_s": call_s, "samples_s": samples, "floor_s": fusion_floor_s,
            "ratio_to_floor": floor_ratio(call_s, fusion_floor_s)}
    assert run(worker.handle(fill)) == m.Ack()  # full rings again: the timed rows evicted the oldest positions
    recorder = RecordingExperts(drafter.experts_fn)
    drafter.set_experts(recorder)
    try:  # untimed: which experts one proposal selects (the same for every repeat: same inputs)
        run(worker.handle(draft_request(2, request_ids, CONTEXT_POSITIONS, 0.0, block_size)))
    finally:
        drafter.set_experts(recorder.inner)
    from moemesh.common.placement.cost import ModelCosts

    bytes_per_expert = ModelCosts.from_config(config).bytes_per_expert  # as stored (FP4 + scales)
    distinct = [recorder.distinct[stage] for stage in sorted(recorder.distinct)]
    floor_bytes = (groups["stages_bytes"] + sum(distinct) * bytes_per_expert + groups["head_bytes"]
                   + block_size * groups["markov_w2_bytes"])
    num_tokens = num_requests * block_size
    row["distinct_experts_per_stage"] = distinct
    row["expected_distinct_uniform"] = expected_distinct(config.n_routed_experts, config.num_experts_per_tok,
                                                         num_tokens)
    row["propose_floor_bytes"] = floor_bytes
    row["propose_floor_s"] = floor_s(floor_bytes, bw)
    for temperature in temperatures:
        request = draft_request(3, request_ids, CONTEXT_POSITIONS, temperature, block_size)
        before = (worker.timings.forward_s_total, worker.timings.chains_s_total, worker.timings.num_proposals)
        replies = []
        call_s, samples = _median_s(lambda: replies.append(run(worker.handle(request))), device, args.warmup,
                                    args.repeats)
        calls = worker.timings.num_proposals - before[2]
        reply = replies[-1]
        assert isinstance(reply, m.DraftTokens), reply
        num_drafts = [len(p.token_ids) for p in reply.proposals]
        row["propose"][f"temperature_{temperature:g}"] = {
            "median_s": call_s, "samples_s": samples,
            "forward_mean_s": (worker.timings.forward_s_total - before[0]) / calls,
            "chains_mean_s": (worker.timings.chains_s_total - before[1]) / calls,
            "num_drafts_min": min(num_drafts), "num_drafts_max": max(num_drafts),
            "ratio_to_floor": floor_ratio(call_s, row["propose_floor_s"])}
    run(worker.handle(m.DraftRequest(step_id=4, slots=(), finished_request_ids=tuple(request_ids))))
    return row


# ------------------------------------------------------------------------------------ main
def build_worker(model_dir: Path, device_name: str):
    from moemesh.common.speculation_width import SpeculationConfig, SpeculationMode
    from moemesh.common.drafting.proposer import DrafterConfig, load_drafter, resolve_numerics
    from moemesh.services.draft.worker import DraftWorker

    drafter = load_drafter(str(model_dir), device_name, resolve_numerics("auto", device_name))
    speculation = SpeculationConfig(SpeculationMode.FIXED, width=drafter.dspark.block_size)
    # temperature > 0 rows measure the sampled chains (top-64 supports), not serve's default greedy drafting
    return DraftWorker(DrafterConfig(device=device_name, speculation=speculation, draft_sampling="sampled"),
                       drafter=drafter)


def main(argv=None) -> int:
    import torch

    from moemesh.bench.layers_timing import measure_ceilings
    from moemesh.bench.results_io import write_result
    from moemesh.bench.random_checkpoint import cached_checkpoint

    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # ceilings and kernels on this device
    batches = [int(b) for b in args.batches.split(",") if b]
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    model_dir = args.checkpoint or cached_checkpoint(hub_config(args.tiny), seed=args.seed,
                                                     routing_skew=args.routing_skew, cache_dir=args.checkpoint_cache)
    started = time.perf_counter()
    worker = build_worker(model_dir, args.device)
    sync(device)
    build_s = time.perf_counter() - started
    drafter = worker.drafter
    sizes = drafter_weight_bytes(drafter)
    groups = weight_groups(drafter)
    ceilings = measure_ceilings(device)
    memory = {}
    if device.type == "cuda":
        memory = {"allocated_bytes": torch.cuda.memory_allocated(device),
                  "max_allocated_bytes": torch.cuda.max_memory_allocated(device)}
    print(f"drafter on {device} ({drafter.dtype}), loaded from {model_dir} in {build_s:.1f} s: FP8 linears "
          f"{sizes['fp8_linear_bytes'] / 1e9:.3f} GB, routed experts {sizes['routed_expert_bytes'] / 1e9:.3f} GB, "
          f"other {sizes['other_bytes'] / 1e9:.3f} GB, shared embed+head {sizes['shared_bytes'] / 1e9:.3f} GB; "
          f"copy bandwidth {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s; memory {memory}")
    loop = asyncio.new_event_loop()
    rows: list[dict] = []
    probes: list[dict] = []
    complete = False
    previous_handler = signal.signal(signal.SIGTERM, _stop_on_sigterm)  # a capped run still writes its rows
    try:
        for num_requests in batches:
            rows.append(time_batch(worker, loop, num_requests, temperatures, args, ceilings, groups))
            print_row(rows[-1])
        if args.probe:
            from moemesh.bench.fullsize_draft_probe import run_probes

            probes = run_probes(worker, loop, batches, args.repeats, features_message, draft_request,
                                CONTEXT_POSITIONS)
        complete = True
    except _Stopped:
        print(f"stopped by SIGTERM after {len(rows)} of {len(batches)} batch sizes")
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        loop.close()
        raw = {"device": str(device), "dtype": str(drafter.dtype), "tiny": args.tiny, "seed": args.seed,
               "routing_skew": args.routing_skew, "checkpoint": str(model_dir), "load_s": build_s,
               "complete": complete, "weight_bytes": sizes,
               "weight_groups": groups, "ceilings": ceilings, "memory": memory, "repeats": args.repeats,
               "warmup": args.warmup, "batches": rows, "probes": probes}
        ratios = {f"propose_A{row['num_requests']}_{key}_vs_floor": v["ratio_to_floor"]
                  for row in rows for key, v in row["propose"].items()}
        path = write_result("fullsize-draft", raw, ratios, out_dir=args.out_dir)
        print(f"wrote {path}")
    return 0 if complete else 1


class _Stopped(Exception):
    pass


def _stop_on_sigterm(signum, frame) -> None:
    raise _Stopped()


def print_row(row: dict) -> None:
    features = "  ".join(f"add_features {key} {v['median_s'] * 1e3:.3f} ms ({v['ratio_to_floor']:.1f}x floor)"
                         for key, v in row["add_features"].items())
    print(f"A={row['num_requests']:3d}  distinct experts/stage {row['distinct_experts_per_stage']} "
          f"(uniform {row['expected_distinct_uniform']:.1f})  floor {row['propose_floor_s'] * 1e3:.3f} ms "
          f"({row['propose_floor_bytes'] / 1e9:.2f} GB)  {features}")
    for key, v in row["propose"].items():
        print(f"        propose {key}: {v['median_s'] * 1e3:8.3f} ms = {v['ratio_to_floor']:5.1f}x floor "
              f"(forward {v['forward_mean_s'] * 1e3:.3f} ms, chains {v['chains_mean_s'] * 1e3:.3f} ms, "
              f"drafts {v['num_drafts_min']}..{v['num_drafts_max']})")


if __name__ == "__main__":
    raise SystemExit(main())
