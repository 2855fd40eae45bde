"""`moemesh router|attention|expert|draft --config FILE [--name NAME]`: run one service.

The deployment TOML (common.runtime.deployment) describes every process; `--name` picks this
process's entry when its role has several. Heavy imports (torch for the workers) happen in
`run()` only, inside the service's own `main`, so `moemesh router` never imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    from moemesh.common.runtime.deployment import add_deployment_arguments

    add_deployment_arguments(parser)
    parser.add_argument("--name", default=None, help="this worker's name in the deployment (needed when the "
                        "role has several workers)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    if name == "router":
        from moemesh.commands.serve_args import add_request_limit_arguments

        add_request_limit_arguments(parser)
    if name == "attention":
        from moemesh.services.attention.main import add_attention_arguments

        add_attention_arguments(parser)
    if name == "expert":
        parser.add_argument("--expert-dtype", choices=("native", "fp8", "bf16"), default=None,
                            help="what this worker keeps of its routed experts (default: the deployment's "
                                 "expert_dtype, itself native by default)")
    if name == "draft":
        from moemesh.common.drafting.options import add_draft_arguments

        add_draft_arguments(parser)


def deployment_overrides(args: argparse.Namespace) -> list[str]:
    """`--set` overrides, and for the router its request-limit flags as `[router]` keys."""
    overrides = list(args.overrides)
    if args.command_name == "router":
        from moemesh.commands.serve_args import request_limits

        overrides += [f"router.{key}={value}" for key, value in request_limits(args)]
    return overrides


def run(args: argparse.Namespace) -> int:
    """Run the service; with MOEMESH_PROFILE_DIR set, under cProfile (its main thread, where the service's
    loop and handlers run), the statistics written at exit to `<dir>/<role>-<name>-<pid>.prof`."""
    profile_dir = os.environ.get("MOEMESH_PROFILE_DIR")
    if not profile_dir:
        return _run(args)
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(_run, args)
    finally:
        target = Path(profile_dir) / f"{args.command_name}-{args.name or 'main'}-{os.getpid()}.prof"
        target.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(target)


def _run(args: argparse.Namespace) -> int:
    from moemesh.common.runtime.deployment import DeploymentError, load_deployment

    try:
        deployment = load_deployment(args.config, deployment_overrides(args))
    except DeploymentError as error:
        print(f"moemesh {args.command_name}: {error}", file=sys.stderr)
        return 2
    match args.command_name:
        case "router":
            from moemesh.services.router.main import main as router_main

            return router_main(deployment, args.name, args.log_level)
        case "attention":
            from moemesh.services.attention.main import main as attention_main, options_from_args

            return attention_main(deployment, args.name, args.log_level, options_from_args(args))
        case "expert":
            from moemesh.services.expert.main import main as expert_main

            return expert_main(deployment, args.name, args.log_level, expert_dtype=args.expert_dtype)
        case "draft":
            from moemesh.common.drafting.options import options_from_args
            from moemesh.services.draft.main import run as draft_run
            from moemesh.common.speculation_width import SpeculationError

            try:
                return draft_run(deployment, args.name, args.log_level, options_from_args(args))
            except (SpeculationError, DeploymentError) as error:  # bad width or no drafter: refuse at start
                print(f"moemesh draft: {error}", file=sys.stderr)
                return 2
    print(f"unknown service {args.command_name!r}", file=sys.stderr)
    return 2
