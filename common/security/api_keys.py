"""The gateway's API keys: where they come from and how a Bearer token is checked.

Keys come from `security.api_keys` (`--api-key KEY`, repeatable), `security.api_key_file`
(`--api-key-file PATH`: one key per line; blank lines and lines starting with `#` are
ignored) and the `MOEMESH_API_KEY` environment variable (one key), all of them together. A key file is preferred: a key on the command line is
visible to every user through `ps`. A key file readable by group or others is accepted
but logged (`security.api_key_file_readable`), since secret managers often mount files
0644 in containers.

Checking a token never short-cuts: the token's SHA-256 is compared with every key's SHA-256
by `hmac.compare_digest`, all of them, so neither the position of the matching key nor the
length of any key shows in the response time. Only digests are kept in memory.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger("security")

MIN_RECOMMENDED_KEY_LENGTH = 16
API_KEY_ENV = "MOEMESH_API_KEY"


class ApiKeyError(ValueError):
    """An API key or key file that cannot be used; the message says which and why."""


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def check_api_key(key: str, where: str) -> str:
    """A key must be non-empty printable ASCII without spaces (it travels in an HTTP header)."""
    if not key:
        raise ApiKeyError(f"{where}: empty API key")
    if not all(33 <= ord(char) <= 126 for char in key):
        raise ApiKeyError(f"{where}: API keys are printable ASCII without spaces")
    return key


@dataclass(frozen=True)
class ApiKeys:
    """A non-empty set of accepted keys, held as SHA-256 digests."""

    digests: tuple[bytes, ...] = field(repr=False)

    def __post_init__(self) -> None:
        if not self.digests:
            raise ApiKeyError("at least one API key is required")

    @classmethod
    def from_keys(cls, keys: Iterable[str], where: str = "api key") -> ApiKeys:
        checked = [check_api_key(key, where) for key in keys]
        if any(len(key) < MIN_RECOMMENDED_KEY_LENGTH for key in checked):
            log.warning("security.api_key_short", min_recommended_length=MIN_RECOMMENDED_KEY_LENGTH)
        return cls(digests=tuple(dict.fromkeys(_digest(key) for key in checked)))

    @property
    def num_keys(self) -> int:
        return len(self.digests)

    def matches(self, token: str | None) -> bool:
        """Whether `token` is one of the keys, in time independent of which key (if any) matched."""
        if token is None:
            return False
        candidate = _digest(token)
        matched = False
        for digest in self.digests:
            matched |= hmac.compare_digest(candidate, digest)
        return matched


def read_api_key_file(path: str | Path) -> tuple[str, ...]:
    """The keys in a key file (see the module docstring for the format)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        raise ApiKeyError(f"{path}: no such API key file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ApiKeyError(f"{path}: cannot read: {error}") from None
    if mode & 0o077:
        log.warning("security.api_key_file_readable", path=str(path), mode=f"{mode:04o}")
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keys.append(check_api_key(stripped, f"{path}:{number}"))
    if not keys:
        raise ApiKeyError(f"{path}: no API keys in the file")
    return tuple(keys)


def env_api_keys(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The key in `MOEMESH_API_KEY` (surrounding whitespace stripped), or () when unset or empty."""
    value = (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip()
    return (check_api_key(value, API_KEY_ENV),) if value else ()


def collect_api_keys(keys: Iterable[str] = (), key_file: str | Path | None = None,
                     environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Every key the flags, the key file and `MOEMESH_API_KEY` give, checked, first seen first."""
    collected = [check_api_key(key, "--api-key") for key in keys]
    if key_file is not None:
        collected.extend(read_api_key_file(key_file))
    collected.extend(env_api_keys(environ))
    return tuple(dict.fromkeys(collected))


def load_api_keys(keys: Iterable[str] = (), key_file: str | Path | None = None,
                  environ: Mapping[str, str] | None = None) -> ApiKeys | None:
    """ApiKeys from explicit keys, a key file and `MOEMESH_API_KEY`; None when none gives any (auth off)."""
    collected = collect_api_keys(keys, key_file, environ)
    if not collected:
        return None
    api_keys = ApiKeys.from_keys(collected)
    log.info("security.api_keys_loaded", num_keys=api_keys.num_keys, from_file=key_file is not None,
             from_env=bool(env_api_keys(environ)))
    return api_keys


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
