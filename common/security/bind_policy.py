"""Which endpoints a moemesh server may bind (docs/design.md §3).

- `ipc://path`: always (file permissions guard it; one host only).
- `tcp://` on a loopback address (127.0.0.0/8, ::1, localhost): always.
- `tcp://` on any other address, including the wildcards `0.0.0.0`, `*` and `::`: only when
  the socket is a CURVE server (authenticated and encrypted), or when the operator asked for
  it explicitly with `--insecure` (a trusted, isolated network; logged at warning level).
- Anything else (inproc://, udp://, typos): refused.

`BindRefused` is a ValueError so callers that guard binds with `except ValueError` keep working.
"""

from __future__ import annotations

import ipaddress

import structlog

log = structlog.get_logger("security")

_LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


class BindRefused(ValueError):
    """A bind the policy forbids; the message says why and what would allow it."""


def endpoint_host(endpoint: str) -> str | None:
    """The host part of a tcp:// endpoint (brackets of an IPv6 literal removed); None for other schemes."""
    if not endpoint.startswith("tcp://"):
        return None
    address = endpoint[len("tcp://"):]
    host, separator, _port = address.rpartition(":")
    if not separator:
        raise BindRefused(f"{endpoint}: tcp endpoints are tcp://host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def is_loopback_host(host: str) -> bool:
    """True for loopback addresses and names; wildcards and interface names are not loopback."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name (eth0) or a host name: may well be reachable from outside


def needs_curve(endpoint: str) -> bool:
    """Whether binding `endpoint` reaches beyond this host (so CURVE is required)."""
    host = endpoint_host(endpoint)
    return host is not None and not is_loopback_host(host)


def check_bind_endpoint(endpoint: str, *, curve_enabled: bool = False, insecure: bool = False) -> None:
    """Raise BindRefused unless the policy above allows binding `endpoint`."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) == len("ipc://"):
            raise BindRefused(f"{endpoint}: ipc endpoints need a path")
        return
    if not endpoint.startswith("tcp://"):
        raise BindRefused(f"{endpoint}: only ipc:// and tcp:// endpoints are supported")
    if not needs_curve(endpoint) or curve_enabled:
        return
    if insecure:
        log.warning("security.insecure_bind", endpoint=endpoint,
                    detail="bound beyond loopback without CURVE: unauthenticated and unencrypted")
        return
    raise BindRefused(
        f"{endpoint}: binding beyond loopback needs CURVE keys (set security.keys_dir or --keys-dir; "
        "create them with `moemesh keys generate`), or --insecure on a trusted network"
    )
