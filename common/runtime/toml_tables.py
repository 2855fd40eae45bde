"""Typed TOML tables: `--set key=value` overrides on a raw table, and a frozen dataclass built from a table.

Errors (`TableError`) name the key they are about (`expert[1].device`, `router.port`), so a bad file or override
fails naming it; the deployment (`deployment.py`) reads its file through these.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from typing import Any


class TableError(ValueError):
    """A key that is missing, unknown, of the wrong type or badly written; the message starts with the key."""


_SEGMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+)\])?$")


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply `a.b[1].c=value` to the raw table in place. Values parse as TOML when they
    can (`3`, `true`, `"x"`, `[1, 2]`) and are taken as plain strings otherwise."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise TableError(f"{override!r}: overrides are key=value")
    key = key.strip()
    try:
        value = tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    parts: list[str | int] = []
    for segment in key.replace("]", "].").split("."):
        if segment.isdigit():
            parts.append(int(segment))
            continue
        if not segment:
            continue
        match = _SEGMENT.match(segment)
        if match is None:
            raise TableError(f"{key}: bad key syntax")
        parts.append(match.group(1))
        if match.group(2) is not None:
            parts.append(int(match.group(2)))
    node: Any = raw
    for position, part in enumerate(parts[:-1]):
        following = parts[position + 1]
        where = _render_key(parts[: position + 1])
        if isinstance(part, int):
            if not isinstance(node, list) or part > len(node):
                raise TableError(f"{where}: no such entry")
            if part == len(node):
                node.append({})  # one past the end: a new entry (e.g. an expert worker joining)
            node = node[part]
            continue
        child = node.setdefault(part, [] if isinstance(following, int) else {})
        if isinstance(child, list) and not isinstance(following, int):
            if len(child) != 1:
                raise TableError(f"{where}: {len(child)} entries, name one as {part}[i]")
            child = child[0]
        node = child
    last = parts[-1]
    if isinstance(last, int) or not isinstance(node, dict):
        raise TableError(f"{key}: must name a key inside a table")
    node[last] = value


def _render_key(parts: list[str | int]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def build_dataclass(cls: type, table: Any, where: str) -> Any:
    """Build dataclass `cls` from a TOML table; errors name the key (`expert[1].device`)."""
    if not isinstance(table, dict):
        raise TableError(f"{where or '<root>'}: expected a table, got {type(table).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise TableError(f"{_join(where, unknown[0])}: unknown key (known: {sorted(fields)})")
    values = {}
    for name, item in table.items():
        values[name] = _convert(hints[name], item, _join(where, name))
    for name, spec in fields.items():
        if name not in values and spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise TableError(f"{_join(where, name)}: required key is missing")
    return cls(**values)


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [arg for arg in args if arg is not type(None)]
        return _convert(non_none[0], value, where)  # TOML has no null: a present key is a value
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise TableError(f"{where}: expected an array, got {type(value).__name__}")
        return tuple(_convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if tp is float and type(value) in (int, float):
        return float(value)
    if tp in (str, int, bool) and type(value) is tp:
        return value
    raise TableError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__} {value!r:.40}")
