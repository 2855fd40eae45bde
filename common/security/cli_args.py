"""Command-line flags for security, expressed as deployment overrides.

Every flag here appends a `--set`-style override (`security.keys_dir="..."`) to the same
`overrides` list that `--set KEY=VALUE` fills, so `load_deployment(args.config, args.overrides)`
sees them and the deployment config stays the single source of truth (one frozen object,
no second path for settings). Flags are applied after the TOML file, in command-line order.

    --keys-dir DIR         security.keys_dir      (CURVE key pairs; see `moemesh keys generate`)
    --insecure             security.insecure      (allow tcp beyond loopback without CURVE)
    --api-key KEY          security.api_keys      (gateway only; repeatable; visible in `ps`)
    --api-key-file PATH    security.api_key_file  (gateway only; one key per line)
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Sequence
from typing import Any


def toml_string(value: str) -> str:
    """`value` as a TOML basic string (JSON's escapes are a subset of TOML's; raw non-ASCII is valid TOML)."""
    return json.dumps(value, ensure_ascii=False)


class _AppendOverride(argparse.Action):
    """Append `<key>=<TOML value>` to namespace.overrides."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, override_key: str,
                 constant: str | None = None, **kwargs: Any) -> None:
        self.override_key = override_key
        self.constant = constant
        if constant is not None:
            kwargs["nargs"] = 0
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        overrides = list(getattr(namespace, self.dest, None) or [])
        value = self.constant if self.constant is not None else toml_string(values)
        overrides.append(f"{self.override_key}={value}")
        setattr(namespace, self.dest, overrides)


_API_KEYS_PREFIX = "security.api_keys="


class _AppendApiKey(argparse.Action):
    """Repeated --api-key flags accumulate into one `security.api_keys=[...]` override."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        previous = getattr(namespace, self.dest, None) or []
        keys: list[str] = []
        for item in previous:
            if item.startswith(_API_KEYS_PREFIX):
                keys = tomllib.loads("value = " + item[len(_API_KEYS_PREFIX):])["value"]
        keys.append(values)
        overrides = [item for item in previous if not item.startswith(_API_KEYS_PREFIX)]
        overrides.append(_API_KEYS_PREFIX + "[" + ", ".join(toml_string(key) for key in keys) + "]")
        setattr(namespace, self.dest, overrides)


def add_security_arguments(parser: argparse.ArgumentParser, dest: str = "overrides") -> None:
    """Add the four flags above; they write into `dest` (the list `--set` appends to)."""
    parser.add_argument("--keys-dir", dest=dest, action=_AppendOverride, override_key="security.keys_dir",
                        metavar="DIR", help="directory of CURVE key pairs (enables CURVE on every socket)")
    parser.add_argument("--insecure", dest=dest, action=_AppendOverride, override_key="security.insecure",
                        constant="true", help="allow binding tcp beyond loopback without CURVE (trusted networks only)")
    parser.add_argument("--api-key", dest=dest, action=_AppendApiKey, metavar="KEY",
                        help="gateway: accept this Bearer token (repeatable; prefer --api-key-file)")
    parser.add_argument("--api-key-file", dest=dest, action=_AppendOverride, override_key="security.api_key_file",
                        metavar="PATH", help="gateway: file with one accepted Bearer token per line")
