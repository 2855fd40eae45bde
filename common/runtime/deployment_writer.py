"""Writing a deployment file: the TOML that `load_deployment` (deployment.py) reads back.

`format_deployment` renders a table (or a `Deployment`) as tables of scalars and arrays of tables;
`write_deployment_file` writes it. Every writer of a deployment (serve, the local cluster, the
benchmarks) goes through here; strings are quoted by `toml_string`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from moemesh.common.runtime.deployment import Deployment
from moemesh.common.security.cli_args import toml_string


def deployment_table(deployment: Deployment) -> dict[str, Any]:
    """A Deployment as the TOML table `parse_deployment` reads (None values left out: TOML has no null)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items() if item is not None}
        if isinstance(value, (list, tuple)):
            return [strip(item) for item in value]
        return value

    return strip(dataclasses.asdict(deployment))


def format_deployment(table: dict[str, Any] | Deployment) -> str:
    """Deployment TOML text: tables of scalars (or arrays of scalars) and arrays of such tables."""
    if isinstance(table, Deployment):
        table = deployment_table(table)
    lines: list[str] = []
    for key, value in table.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{name} = {_toml_value(item)}" for name, item in value.items()), ""]
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            for item in value:
                lines += [f"[[{key}]]", *(f"{name} = {_toml_value(entry)}" for name, entry in item.items()), ""]
        else:
            lines.insert(0, f"{key} = {_toml_value(value)}")
    return "\n".join(lines)


def write_deployment_file(path: str | Path, table: dict[str, Any] | Deployment) -> Path:
    """Write the deployment TOML of `table` to `path` (read back with `load_deployment`)."""
    path = Path(path)
    path.write_text(format_deployment(table), encoding="utf-8")
    return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as a TOML value")
