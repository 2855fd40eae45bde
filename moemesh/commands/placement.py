"""`moemesh placement plan|show`: plan an expert placement from routing statistics and budgets.

    moemesh placement plan --preset v4-flash --stats stats.csv \
        --budget cuda:0=80GiB --budget cpu=100GiB --throughput cuda:0=4000GB/s --throughput cpu=100GB/s \
        [--replicate-hot N] [--policy hottest|balanced] [--out placement.toml]
    moemesh placement show placement.toml [--preset v4-flash]
    moemesh placement show --url http://router:8000    (the expert workers registered with a router)

    moemesh placement apply placement.toml --url http://router:8000   (moemesh/commands/placement_apply.py)

Pure Python: no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_MODEL = "models/kjv-dsv4-mini"


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    sub = parser.add_subparsers(dest="placement_command", metavar="ACTION")
    plan = sub.add_parser("plan", help="plan a placement from routing statistics and device budgets")
    _add_model_arguments(plan)
    plan.add_argument("--stats", action="append", default=[], metavar="FILE",
                      help="routing-statistics CSV (ours or Lucebox's); repeat to merge; none = uniform plan")
    plan.add_argument("--phase", choices=("all", "prefill", "decode"), default="all",
                      help="which counts of the statistics to plan for (default: all)")
    plan.add_argument("--budget", action="append", default=[], metavar="DEV=SIZE", required=True,
                      help="memory for routed experts on a device, e.g. cuda:0=80GiB (repeat per device)")
    plan.add_argument("--throughput", action="append", default=[], metavar="DEV=RATE",
                      help="measured expert throughput: cuda:0=4000GB/s (weight reads) or cuda:0=2e6tok/s "
                           "(expert-tokens); both may be given; none = an assumed bandwidth per device kind")
    plan.add_argument("--hop-us", action="append", default=[], metavar="DEV=US",
                      help="per-layer dispatch round trip to the device's worker in microseconds (default 0)")
    plan.add_argument("--attention-device", default=None,
                      help="device of the attention worker (default: the first --budget device; 'none': elsewhere)")
    plan.add_argument("--attention-us", type=float, default=None,
                      help="attention + shared-expert time per layer in microseconds (default: from weight bytes)")
    plan.add_argument("--tokens-per-step", type=int, default=32, help="tokens per step in the time model")
    plan.add_argument("--replicate-hot", type=int, default=0, metavar="N",
                      help="give the N hottest experts of each layer a second copy where budget allows")
    plan.add_argument("--policy", choices=("hottest", "balanced"), default="balanced")
    plan.add_argument("--out", default="placement.toml", help="placement file to write (TOML)")
    plan.add_argument("--json", action="store_true", help="print the per-device table as JSON")
    show = sub.add_parser("show", help="print what a placement file holds and check it, or (--url) the expert "
                          "workers registered with a running router")
    show.add_argument("file", nargs="?", default=None, help="placement TOML")
    show.add_argument("--url", default=None, help="a running router's base URL: list its registered expert workers")
    show.add_argument("--api-key", default=None, help="bearer key for --url (default: $MOEMESH_API_KEY)")
    _add_model_arguments(show, required=False)
    show.add_argument("--layers", action="store_true", help="also list each worker's experts per layer")
    from moemesh.commands.placement_apply import add_apply_arguments

    add_apply_arguments(sub)


def _add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model", default=None,
                       help=f"checkpoint directory whose config.json describes the model (default {DEFAULT_MODEL})"
                       if required else "checkpoint directory to validate against")
    group.add_argument("--config-json", default=None, help="a config.json file instead of a checkpoint")
    group.add_argument("--preset", choices=("v4-flash",), default=None, help="built-in model config")


def run(args: argparse.Namespace) -> int:
    from moemesh.common.model.config import ConfigError
    from moemesh.common.placement.devices import DeviceSpecError
    from moemesh.common.placement.placement_file import PlacementError
    from moemesh.common.placement.plan import PlacementInfeasible
    from moemesh.common.placement.stats import StatsError

    action = getattr(args, "placement_command", None)
    if action is None:
        print("usage: moemesh placement {plan,show,apply} ...", file=sys.stderr)
        return 2
    try:
        if action == "apply":
            from moemesh.commands.placement_apply import run_apply

            return run_apply(args)
        if action == "show" and args.url is not None:
            return _show_registered(args)
        if action == "show" and args.file is None:
            raise ValueError("show needs a placement FILE or --url URL")
        return _plan(args) if action == "plan" else _show(args)
    except (ConfigError, DeviceSpecError, PlacementError, PlacementInfeasible, StatsError, OSError,
            ValueError) as error:
        print(f"moemesh placement {action}: error: {error}", file=sys.stderr)
        return 1


def _load_config(args: argparse.Namespace, required: bool = True):
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.model.presets import preset_config

    if args.preset:
        return preset_config(args.preset)
    if args.config_json:
        return ModelConfig.load(args.config_json)
    model = args.model if args.model else (DEFAULT_MODEL if required else None)
    if model is None:
        return None
    path = Path(model)
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json; pass --config-json FILE or --preset v4-flash")
    return ModelConfig.load(path)


def _plan(args: argparse.Namespace) -> int:
    from moemesh.common.placement.cost import CostConfig, ModelCosts
    from moemesh.common.placement.devices import build_devices
    from moemesh.common.placement.placement_file import validate_placement, write_placement
    from moemesh.common.placement.plan import PlanConfig, Policy, plan_placement
    from moemesh.common.placement.stats import ALL_PHASES, Phase, read_stats_files

    costs = ModelCosts.from_config(_load_config(args))
    devices = build_devices(args.budget, args.throughput, args.hop_us)
    attention_device = devices[0].name if args.attention_device is None else args.attention_device
    if attention_device == "none":
        attention_device = None
    shares, stats_text = None, "none (uniform plan)"
    if args.stats:
        stats = read_stats_files(args.stats)
        if (stats.num_layers, stats.num_experts) != (costs.num_layers, costs.num_experts):
            raise ValueError(f"statistics are {stats.num_layers} layers x {stats.num_experts} experts, the model "
                             f"has {costs.num_layers} x {costs.num_experts}")
        phases = ALL_PHASES if args.phase == "all" else (Phase(args.phase),)
        if stats.num_activations(phases) == 0:
            raise ValueError(f"the statistics hold no {args.phase} counts")
        shares = stats.shares(phases)
        stats_text = f"{', '.join(args.stats)} ({args.phase}: {stats.num_activations(phases):,} activations)"
    config = PlanConfig(
        policy=Policy(args.policy),
        num_replicated_hot=args.replicate_hot,
        cost=CostConfig(args.tokens_per_step, attention_device,
                        None if args.attention_us is None else args.attention_us * 1e-6),
    )
    result = plan_placement(costs, devices, shares, config, ", ".join(args.stats) or None)
    validate_placement(result.placement, costs.num_layers, costs.num_experts, costs.bytes_per_expert)
    write_placement(args.out, result.placement)
    if args.json:
        print(json.dumps({
            "out": args.out, "policy": args.policy, "objective_s": result.evaluation.objective_s,
            "devices": [summary.__dict__ for summary in result.summaries],
        }))
        return 0
    _print_plan(result, costs, stats_text, config, args.out)
    return 0


def _print_plan(result, costs, stats_text: str, config, out: str) -> None:
    from moemesh.common.placement.devices import format_bytes

    print(f"placement plan: policy {config.policy.value}, {costs.num_layers} layers x {costs.num_experts} experts, "
          f"{format_bytes(costs.bytes_per_expert)} per expert")
    print(f"statistics: {stats_text}")
    attention = config.cost.attention_device or "not on an expert device"
    print(f"time model: {config.cost.tokens_per_step} tokens per step, attention + shared expert on {attention}")
    print(f"{'device':<8} {'worker':<14} {'experts':>8} {'replicas':>8} {'bytes':>12} {'budget':>12} "
          f"{'token share':>11} {'layer time':>11}")
    for s in result.summaries:
        note = "  (throughput assumed; pass --throughput)" if s.throughput_assumed else ""
        print(f"{s.device:<8} {s.worker_name:<14} {s.num_experts:>8} {s.num_replicas:>8} "
              f"{format_bytes(s.num_bytes):>12} {format_bytes(s.budget_bytes):>12} "
              f"{100 * s.token_share:>10.1f}% {1e3 * s.mean_layer_s:>8.3f} ms{note}")
    print(f"expected MoE time per step: {1e3 * result.evaluation.objective_s:.3f} ms "
          f"(sum over {costs.num_layers} layers of the slowest branch)")
    print(f"wrote {out}")


def _show(args: argparse.Namespace) -> int:
    from moemesh.common.placement.cost import ModelCosts
    from moemesh.common.placement.devices import format_bytes
    from moemesh.common.placement.placement_file import format_ranges, group_by_layer, placement_problems, read_placement

    placement = read_placement(args.file)
    config = _load_config(args, required=False)
    if config is None:
        problems = placement_problems(placement, placement.num_layers, placement.num_experts)
        checked = "checked against its own shape (pass --model/--config-json/--preset to check the model)"
    else:
        costs = ModelCosts.from_config(config)
        problems = placement_problems(placement, costs.num_layers, costs.num_experts, costs.bytes_per_expert)
        checked = "checked against the model config"
    print(f"{args.file}: {placement.num_layers} layers x {placement.num_experts} experts, "
          f"{format_bytes(placement.bytes_per_expert)} per expert, policy {placement.policy or '?'}, "
          f"statistics {placement.stats_source or 'none'}")
    print(f"{'worker':<14} {'device':<8} {'experts':>8} {'replicas':>8} {'bytes':>12} {'token share':>11}")
    for worker in placement.workers:
        share = "?" if worker.expected_token_share is None else f"{100 * worker.expected_token_share:.1f}%"
        print(f"{worker.name:<14} {worker.device:<8} {len(worker.expert_ids):>8} {len(worker.replica_ids):>8} "
              f"{format_bytes(placement.worker_bytes(worker.name)):>12} {share:>11}")
        if args.layers:
            for label, ids in (("experts", worker.expert_ids), ("replicas", worker.replica_ids)):
                for layer, experts in group_by_layer(ids).items():
                    print(f"    {label} layer {layer}: {format_ranges(experts)}")
    if problems:
        print(f"INVALID ({checked}):")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"valid ({checked})")
    return 0


def _show_registered(args: argparse.Namespace) -> int:
    """`placement show --url`: GET /v1/admin/experts and print one row per registered worker."""
    import os

    import httpx

    from moemesh.common.placement.devices import format_bytes

    key = args.api_key or os.environ.get("MOEMESH_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(args.url.rstrip("/") + "/v1/admin/experts", headers=headers, timeout=30)
    except httpx.HTTPError as error:
        print(f"moemesh placement show: error: {error}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"moemesh placement show: error {response.status_code}: {response.text[:300]}", file=sys.stderr)
        return 1
    body = response.json()
    applied = body["applied_workers"]
    print(f"{args.url}: placement version {body['placement_version']} "
          f"({'the deployment files' if applied is None else 'applied: ' + ', '.join(applied)})")
    print(f"{'worker':<14} {'device':<8} {'state':<12} {'pid':>8} {'experts':>8} {'bytes':>12} {'free budget':>12}  endpoint")
    for worker in body["workers"]:
        free = "?" if worker["free_budget_bytes"] is None else format_bytes(worker["free_budget_bytes"])
        print(f"{worker['name']:<14} {worker['device']:<8} {worker['state']:<12} {worker['pid']:>8} "
              f"{worker['num_experts']:>8} {format_bytes(worker['num_weight_bytes']):>12} {free:>12}  "
              f"{worker['endpoint']}")
        if args.layers:
            from moemesh.common.placement.placement_file import format_ranges

            for layer, experts in worker["experts_by_layer"].items():
                print(f"    layer {layer}: {format_ranges(experts)}")
    return 0
