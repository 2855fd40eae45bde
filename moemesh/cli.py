"""The `moemesh` command: one sub-command per module under `moemesh.commands`.

Each command module defines `add_arguments(parser)` and `run(args) -> int`. Modules are
imported only when their command runs, so `moemesh router` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> (module under moemesh.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate", "generate text with the single-process reference model (or --distributed)"),
    "check-model": ("check_model", "print what a checkpoint holds and run one forward"),
    "serve": ("serve", "start router, attention worker, expert workers (and drafter) on one host"),
    "router": ("service", "run the router/gateway service from a deployment config"),
    "attention": ("service", "run an attention worker from a deployment config"),
    "expert": ("service", "run an expert worker from a deployment config"),
    "draft": ("service", "run the DSpark draft worker from a deployment config"),
    "devices": ("devices", "list torch devices and their memory"),
    "bench": ("bench", "benchmarks and measuring tools (moemesh bench --list names them)"),
    "placement": ("placement", "plan and apply expert placements"),
    "keys": ("keys", "generate CURVE key pairs for multi-host deployments"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    parser = argparse.ArgumentParser(prog="moemesh", description="moemesh: disaggregated MoE inference")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules: dict[str, object] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(f"moemesh.commands.{module_name}")
        except ModuleNotFoundError as error:
            if error.name != f"moemesh.commands.{module_name}":
                raise
            continue  # command not built yet
        command_parser = sub.add_parser(name, help=help_text)
        command_parser.set_defaults(command_name=name)
        module.add_arguments(command_parser, name)
        modules[name] = module
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
