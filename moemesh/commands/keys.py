"""`moemesh keys`: CURVE key pairs for the services of a deployment.

    moemesh keys generate --out DIR --name NAME [--name NAME ...] [--force]
    moemesh keys generate --out DIR --config deployment.toml     # router + every worker
    moemesh keys show DIR                                         # names and public keys

Each name gets `<name>.key` (public, 0644) and `<name>.key_secret` (0600) in DIR; see
`common.security.curve` for the format and deploy/README.md for which file goes to which host.
Existing key pairs are kept unless --force.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    actions = parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    generate = actions.add_parser("generate", help="write CURVE key pairs (<name>.key, <name>.key_secret)")
    generate.add_argument("--out", required=True, help="keys directory (created with mode 0700)")
    generate.add_argument("--name", dest="names", action="append", default=[], metavar="NAME",
                          help="service name: router, or a worker's name in the deployment (repeatable)")
    generate.add_argument("--config", help="deployment TOML: generate for the router and every worker in it")
    generate.add_argument("--force", action="store_true", help="replace existing key pairs")
    show = actions.add_parser("show", help="list the public keys in a keys directory")
    show.add_argument("directory")


def run(args: argparse.Namespace) -> int:
    from moemesh.common.security.curve import KeyFileError

    try:
        if args.keys_action == "generate":
            return _generate(args)
        return _show(args.directory)
    except (ValueError, KeyFileError, FileExistsError, OSError) as error:
        print(f"moemesh keys: {error}", file=sys.stderr)
        return 1


def _generate(args: argparse.Namespace) -> int:
    from moemesh.common.security.curve import check_key_name, generate_key_pair, key_file_paths, write_key_pair

    names = list(args.names)
    if args.config:
        from moemesh.common.runtime.deployment import load_deployment
        from moemesh.common.runtime.deployment_security import deployment_key_names

        names.extend(deployment_key_names(load_deployment(args.config)))
    names = list(dict.fromkeys(check_key_name(name) for name in names))
    if not names:
        print("moemesh keys generate: give --name NAME (repeatable) or --config FILE", file=sys.stderr)
        return 2
    if not args.force:  # refuse before writing anything, so a failed run leaves no partial set
        existing = [str(path) for name in names for path in vars(key_file_paths(args.out, name)).values()
                    if path.exists()]
        if existing:
            print(f"moemesh keys generate: already exist (use --force to replace): {', '.join(existing)}",
                  file=sys.stderr)
            return 1
    for name in names:
        pair = generate_key_pair(name)
        paths = write_key_pair(args.out, pair, overwrite=args.force)
        print(f"{name}: {paths.public_path} (public {pair.public_key.decode('ascii')}), {paths.secret_path} (secret, 0600)")
    return 0


def _show(directory: str) -> int:
    from moemesh.common.security.curve import load_public_keys

    for name, public_key in load_public_keys(directory).items():
        print(f"{name}\t{public_key.decode('ascii')}")
    return 0
