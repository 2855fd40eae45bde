"""`moemesh bench fullsize`: DeepSeek-V4-Flash at true width through moemesh's processes, random weights.

    python -m moemesh.bench.fullsize --experts-on cpu|cuda:1 --gpu-expert-budget 100GiB --batch 1,8[,64] \
        --routing uniform,skewed [--layers 43] [--context 512 --context-routing auto|natural|near] \
        [--decode-steps 5 --warmup-steps 2 --run-budget-s S] [--prefill 2048,8192] [--data-plane zmq|cuda_ipc] \
        [--cuda-graphs] [--compare CPU_RUN.json] [--speculation oracle,drafter --spec-width 5
        --draft-device cuda:1] --out-dir DIR
    python -m moemesh.bench.fullsize --tiny ...      # a tiny model on the CPU; checks the split run against in-process

What runs:
- a hub-format checkpoint with random weights (`moemesh bench make-checkpoint`, bench/random_checkpoint.py),
  written once per (config, seed) into --checkpoint-cache (or --checkpoint DIR, used as given): every
  service loads it from disk as `moemesh serve` does;
- two expert worker processes (`bench.fullsize_expert`, the moemesh expert worker with dispatch
  timing): "near" on cuda:0 with the hottest experts under --gpu-expert-budget, "far" on the CPU or
  cuda:1 with the rest (placement: `common.placement.plan`, policy hottest, `bench.fullsize_setup`);
  near shares cuda:0 with the attention worker, so NVIDIA MPS should run (bench/device/fullsize.sh);
  with --data-plane cuda_ipc both CUDA workers map the attention worker's device rings (the cuda:1
  worker reads them and writes its answers over NVLink: peer copies; common/wire/cuda_ipc.py);
- the attention worker (`services.attention.worker.AttentionWorker`, the real class, attention +
  shared experts + head on cuda:0) in this process, talking to both over ZeroMQ (the default data
  plane), driven by the router's scheduler in-process (`services.router.offline_engine`) as
  `moemesh generate --distributed` drives it.
Before anything is timed, every (layer, expert) pair is checked to be served by exactly the worker
the plan gives it (`bench.fullsize_verify`; a mismatch ends the run, exit status 2, naming the pair).
Context: one real prefill step of --context random tokens per sequence (--context-routing near:
routed to the GPU experts only, see `bench.fullsize_runs`), then --warmup-steps decode steps, then
up to --decode-steps measured decode steps (greedy; --run-budget-s caps a slow run, >= 1 step).
"uniform" keeps the checkpoint's gate bias; "skewed" sets the bias a checkpoint written with
--routing-skew c holds (-c·ln(1 + rank), c = --skew; `bench.random_checkpoint.skew_bias`) in the
running attention worker, between runs, so one load serves both routings. A refused Dispatch is
explained (sent vs received) in the run's JSON. Timings and floors: `bench.fullsize_report`. JSON via
bench.results_io ("fullsize").
Speculation (--speculation; `bench.fullsize_spec`): after each plain decode run, the
same prompts again with drafts from the oracle (the plain run's own greedy continuation: full
acceptance, and output must equal the plain run's) and/or the DSpark draft worker process reading the
checkpoint's DSpark stages (V4-Flash drafter shapes; --draft-device, default the far expert device, else
the attention device), verified --spec-width drafts per step; rows under "speculative" in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="moemesh bench fullsize", description=__doc__.splitlines()[0])
    parser.add_argument("--experts-on", default="cpu", help="device of the far expert worker: cpu or cuda:1")
    parser.add_argument("--gpu-expert-budget", default=None,
                        help="bytes of experts on cuda:0, e.g. 100GiB (default: 100GiB; --tiny: 60%% of all)")
    parser.add_argument("--batch", default="1,8", help="decode batch sizes, comma-separated")
    parser.add_argument("--routing", default="uniform,skewed", help="uniform and/or skewed, comma-separated")
    parser.add_argument("--layers", type=int, default=None, help="first N layers of V4-Flash (default all 43)")
    parser.add_argument("--prefill", default="", help="prompt lengths to time as one prefill step, e.g. 2048,8192")
    parser.add_argument("--context", type=int, default=32, help="prompt tokens per sequence before decoding")
    parser.add_argument("--max-context-tokens", type=int, default=None,
                        help="cap on B x --context per decode run: large batches get a shorter context each")
    parser.add_argument("--context-routing", default="auto", choices=("auto", "natural", "near"),
                        help="route the context prefill as the decode (natural) or to the near experts only "
                        "(near); auto: near when the far experts are on the CPU (not --tiny), else natural")
    parser.add_argument("--run-budget-s", type=float, default=None,
                        help="stop measuring a decode run after this many seconds of decode (>= 1 step kept)")
    parser.add_argument("--dispatch-staging", default="on", choices=("on", "off"),
                        help="off: the attention worker sends Dispatches from their own host tensors instead of "
                        "the pinned staging pool (a diagnostic A/B for the data plane)")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=5, help="measured decode steps per run")
    parser.add_argument("--skew", type=float, default=0.1, help="gate bias strength c of the skewed routing")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--data-plane", default="zmq", choices=("zmq", "cuda_ipc"),
                        help="attention <-> expert tensors: ZeroMQ with host staging, or CUDA IPC rings (CUDA "
                        "workers on this host; a worker that cannot map them stays on ZeroMQ)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the attention worker replays CUDA graphs of its decode segments (when it has them)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads of the CPU expert worker (default: all cores but 4)")
    parser.add_argument("--speculation", default="off",
                        help="off, or draft sources run after each plain decode run: oracle,drafter")
    parser.add_argument("--spec-width", type=int, default=5, help="drafts per request and step (the block size 5)")
    parser.add_argument("--spec-diagnose", action="store_true",
                        help="plain and speculative runs keep top-2 logprobs; each speculative row says how far the "
                        "two paths' logprobs differ and how close the plain top-2 were where the outputs part")
    parser.add_argument("--draft-device", default=None,
                        help="device of the draft worker (default: the far expert device if a GPU, else the "
                        "attention device)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="an existing checkpoint to load (default: write one with random weights, cached)")
    parser.add_argument("--checkpoint-cache", type=Path, default=None,
                        help="where written checkpoints are kept (default $MOEMESH_CHECKPOINT_CACHE or "
                        "~/.cache/moemesh/checkpoints)")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (tests, rehearsal)")
    parser.add_argument("--compare", default=None, help="a fullsize JSON (one GPU + CPU) to give ratios against")
    parser.add_argument("--run-dir", default=None, help="where sockets, placement and logs go (default: a temp dir)")
    parser.add_argument("--ready-timeout", type=float, default=240.0)
    parser.add_argument("--dispatch-timeout", type=float, default=300.0)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from moemesh.bench.fullsize_spec import SpecConfig, parse_sources

    sources = parse_sources(args.speculation)
    args.spec = SpecConfig(sources, args.spec_width) if sources else None
    if args.context_routing == "auto":
        args.context_routing = "near" if args.experts_on == "cpu" and not args.tiny else "natural"
    from moemesh.bench.fullsize_verify import PairVerificationError

    with tempfile.TemporaryDirectory(prefix="moemesh-fullsize-") as temp_dir:
        run_dir = Path(args.run_dir) if args.run_dir else Path(temp_dir)
        try:
            result = run(args, run_dir)
        except PairVerificationError as error:
            print(f"PAIR CHECK FAILED: {error}", flush=True)
            if args.out_dir is not None:
                import json

                args.out_dir.mkdir(parents=True, exist_ok=True)
                (args.out_dir / "fullsize-partial.json").write_text(json.dumps(
                    {"partial": True, "pair_check": {"ok": False, "error": str(error)}}, indent=1))
            return 2
    from moemesh.bench.fullsize_report import print_table
    from moemesh.bench.results_io import write_result

    ratios = result.pop("ratios", {})
    path = write_result("fullsize", result, ratios, out_dir=args.out_dir)
    print_table(result)
    print(f"wrote {path}")
    return 0 if result.get("reference_check", {}).get("ok", True) else 1


def run(args, run_dir: Path) -> dict:
    import torch

    from moemesh.bench.fullsize_setup import FAR_WORKER, NEAR_WORKER, FullsizeCluster, plan_split
    from moemesh.bench.fullsize_setup import worker_placement_summary
    from moemesh.bench.fullsize_timing import TimedDispatcher, copy_bandwidth
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.placement.cost import ModelCosts
    from moemesh.common.placement.devices import parse_size
    from moemesh.common.runtime.local_cluster import ClusterSpec
    from moemesh.common.runtime.logging import configure_logging

    configure_logging("fullsize", None, args.log_level)
    attention_device = "cpu" if args.tiny else "cuda:0"
    far_device = "cpu" if args.tiny else args.experts_on
    draft = _draft_process(args, attention_device, far_device)
    model_dir = _checkpoint(args, draft is not None)
    config = ModelConfig.load(model_dir)
    costs = ModelCosts.from_config(config)
    all_expert_bytes = costs.bytes_per_expert * config.num_hidden_layers * config.n_routed_experts
    budget = (parse_size(args.gpu_expert_budget) if args.gpu_expert_budget
              else int(0.6 * all_expert_bytes) if args.tiny else parse_size("100GiB"))
    plan = plan_split(config, attention_device, far_device, budget, args.seed)
    print(f"placement: {plan.num_near_experts} experts near ({attention_device}), {plan.num_far_experts} far "
          f"({far_device}), {plan.bytes_per_expert} bytes each", flush=True)

    bandwidth = {"near_bytes_per_s": copy_bandwidth(torch.device(attention_device)),
                 "far_bytes_per_s": copy_bandwidth(torch.device(far_device)),
                 "method": "median copy of 1 GiB, bytes read + written per second (CUDA events / host clock)",
                 "cpu_threads": torch.get_num_threads()}
    if far_device == "cpu" and attention_device != "cpu":
        bandwidth["host_bytes_per_s"] = bandwidth["far_bytes_per_s"]
    ceilings = None
    if attention_device.startswith("cuda"):
        from moemesh.bench.kernels import measure_ceilings

        ceilings = measure_ceilings()
        torch.cuda.empty_cache()  # the measurement's buffers: cuda:0 memory goes to the experts
    print(f"bandwidth near {bandwidth['near_bytes_per_s'] / 1e9:.0f} GB/s, far "
          f"{bandwidth['far_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)

    spec = ClusterSpec(model_path=str(model_dir), run_dir=str(run_dir), attention_device=attention_device,
                       ready_timeout_s=args.ready_timeout, dispatch_timeout_s=args.dispatch_timeout,
                       step_timeout_s=args.dispatch_timeout, log_level=args.log_level)
    cpu_threads = args.cpu_threads or (None if args.tiny else max(1, (os.cpu_count() or 8) - 4))
    cluster = FullsizeCluster(spec, plan, run_dir / "timing", cpu_threads, draft)
    began_s = time.perf_counter()
    cluster.launch()
    worker = None
    try:
        worker = _attention_worker(args, cluster, str(model_dir), attention_device)
        attention_ready_s = time.perf_counter() - began_s
        cluster.wait_ready()
        ready_s = time.perf_counter() - began_s
        print(f"loaded: attention {attention_ready_s:.1f} s, all workers {ready_s:.1f} s", flush=True)
        worker_dispatcher = worker.runner.dispatcher
        worker.runner.dispatcher = TimedDispatcher(worker_dispatcher)
        if args.dispatch_staging == "off":
            worker.channel.staging = None  # ExpertChannel then sends each Dispatch from its own host tensors
        from moemesh.bench.fullsize_runs import run_all
        from moemesh.bench.fullsize_verify import verify_pairs_served

        endpoints = {name: cluster.endpoint_of(name) for name in cluster.expert_names}
        pair_check = verify_pairs_served(worker_dispatcher, plan, endpoints, list(cluster.expert_names))
        print(f"pair check: every one of {pair_check['num_pairs']} pairs served by its planned worker "
              f"{pair_check['num_held']}", flush=True)
        runs = run_all(args, worker, cluster, config, bandwidth, model_dir, plan)
    finally:
        if worker is not None:
            asyncio.run(worker.close())
        cluster.stop()
    result = {
        "model": "tiny V4-like" if args.tiny else "DeepSeek-V4-Flash shapes", "num_layers": config.num_hidden_layers,
        "weights": (f"checkpoint {model_dir} loaded from disk by every worker (random weights written by "
                    "bench make-checkpoint: FP8 128x128 linears, FP4 e2m1 + ue8m0 1x32 experts)"),
        "checkpoint": str(model_dir),
        "context": f"real prefill of {args.context} random tokens per sequence (routing: "
                   f"{runs.get('context_method', {}).get('routing')}), {args.warmup_steps} warm-up decode steps, "
                   f"then up to {args.decode_steps} measured decode steps"
                   + (f" (at most {args.run_budget_s} s of decode per run)" if args.run_budget_s else ""),
        "pair_check": pair_check, "dispatch_staging": args.dispatch_staging,
        "speculation": "off (--speculation oracle,drafter runs it)",
        "draft_worker": None if draft is None else {"device": draft.device, "width": draft.width, "mode": "fixed",
                                                    "weights": "the checkpoint's DSpark stages",
                                                    "error": cluster.draft_error},
        "attention_device": attention_device, "placement": worker_placement_summary(plan),
        "gpu_expert_budget_bytes": budget, "skew_strength": args.skew,
        "near_worker": NEAR_WORKER, "far_worker": FAR_WORKER,
        "data_plane": ("ZeroMQ ipc with pinned host staging (default)" if args.data_plane == "zmq" else
                       f"{args.data_plane} (workers that could not map the rings stay on ZeroMQ)"),
        "data_plane_workers": _data_plane_workers(worker_dispatcher),
        "gpu_experts_process": "separate expert worker process on cuda:0 (MPS "
                               + ("on" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "not detected") + ")",
        "num_micro_batches": args.micro_batches, "attention_cuda_graphs": args.cuda_graphs, "load_s": ready_s,
        "far_cpu_threads": cpu_threads,
        "bandwidth": bandwidth, "ceilings": ceilings,
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        **runs,
    }
    if args.compare:
        result["ratios"] = _compare(result, args.compare)
    return result


def _attention_worker(args, cluster, model_dir: str, device: str):
    import torch

    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.services.attention.recovery import RecoveryConfig
    from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig

    batches = _ints(args.batch)
    num_steps = args.warmup_steps + args.decode_steps
    tokens_per_seq = args.context + num_steps + 2
    if args.spec is not None:  # the plain run feeding the oracle, and the widest verify step after it
        tokens_per_seq = args.context + args.spec.num_plain_tokens(num_steps) + args.spec.width + 1
    blocks = max(max(batches, default=1) * -(-tokens_per_seq // 128), max([-(-(n + 2) // 128) for n in _ints(args.prefill)],
                                                              default=1)) + 8
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    import dataclasses

    extra = {}
    if args.cuda_graphs:
        if "cuda_graphs" not in {f.name for f in dataclasses.fields(AttentionWorkerConfig)}:
            raise SystemExit("--cuda-graphs: this attention worker has no decode graphs")
        extra["cuda_graphs"] = True
    if args.data_plane != "zmq":
        if "data_plane" not in {f.name for f in dataclasses.fields(AttentionWorkerConfig)}:
            raise SystemExit(f"--data-plane {args.data_plane}: this attention worker has only ZeroMQ")
        extra["data_plane"] = args.data_plane
    if cluster.draft_endpoint is not None:
        extra["draft_endpoint"] = cluster.draft_endpoint
        extra["draft_timeout_s"] = 120.0  # the first feature message may wait for a drafter still compiling
    worker = AttentionWorker(AttentionWorkerConfig(
        name="attention-0", checkpoint_path=model_dir, expert_endpoints=cluster.endpoints(),
        expert_workers=cluster.holdings(), device=device, num_micro_batches=args.micro_batches,
        kv=KVPoolConfig(block_size_tokens=128, num_primary_blocks=blocks), dispatch_timeout_s=args.dispatch_timeout,
        recovery=RecoveryConfig(max_attempts=1),  # a benchmark fails fast and explains (no retries to time)
        **extra))
    worker.load_now()
    return worker


def _checkpoint(args, with_drafter: bool) -> Path:
    """--checkpoint as given, or the random checkpoint of this run's config (written once, cached)."""
    from moemesh.bench.fullsize_setup import model_hub_dict
    from moemesh.bench.random_checkpoint import cached_checkpoint, with_dspark

    if args.checkpoint is not None:
        return args.checkpoint
    hub = model_hub_dict(args.layers, args.tiny)
    if with_drafter:
        hub = with_dspark(hub)  # the DSpark stages at V4-Flash drafter shapes, for the draft worker
    return cached_checkpoint(hub, seed=args.seed, cache_dir=args.checkpoint_cache)


def _draft_process(args, attention_device: str, far_device: str):
    """The draft worker to start (--speculation with drafter), or None."""
    from moemesh.bench.fullsize_setup import DraftProcess

    if args.spec is None or not args.spec.uses_drafter:
        return None
    device = args.draft_device or (far_device if far_device.startswith("cuda") else attention_device)
    return DraftProcess(device=device, width=args.spec.width)


def _data_plane_workers(dispatcher) -> dict:
    """Per expert worker index: "cuda_ipc" when it mapped the rings, else "zmq"; with the slot counts."""
    plane = getattr(dispatcher, "slot_plane", None)
    if plane is None:
        return {"all": "zmq"}
    rings = getattr(plane, "_rings", {})
    return {"workers": {str(i): ("cuda_ipc" if ring is not None else "zmq") for i, ring in rings.items()},
            "num_slot_dispatches": getattr(plane, "num_slot_dispatches", None),
            "num_zmq_fallbacks": getattr(plane, "num_zmq_fallbacks", None)}


def _compare(result: dict, path: str) -> dict:
    """tok/s of this run over the other run's, per (routing, batch) and prefill length."""
    import json

    loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    other = loaded.get("raw", loaded)  # a result file, or a partial one
    theirs = {(r["routing"], r["batch"]): r.get("tokens_per_s") for r in other.get("decode", [])}
    out = {"against": path, "against_far_device": other.get("placement", {}).get("far_device"), "decode": {}}
    for r in result.get("decode", []):
        key = (r["routing"], r["batch"])
        if theirs.get(key) and r.get("tokens_per_s"):
            out["decode"][f"{r['routing']}_b{r['batch']}"] = r["tokens_per_s"] / theirs[key]
    their_prefill = {p["num_tokens"]: p.get("tokens_per_s") for p in other.get("prefill", [])}
    out["prefill"] = {str(p["num_tokens"]): p["tokens_per_s"] / their_prefill[p["num_tokens"]]
                      for p in result.get("prefill", []) if their_prefill.get(p["num_tokens"]) and "tokens_per_s" in p}
    return out


if __name__ == "__main__":
    sys.exit(main())
