"""The ZAP handler that decides which CURVE clients a process's server sockets admit.

ZeroMQ asks the context's ZAP handler (an inproc socket, `inproc://zeromq.zap.01`) about
every CURVE handshake. `ClientAuthenticator` runs pyzmq's `ThreadAuthenticator` on its own
thread, so an event loop busy in a long step (or a blocking SyncClient round trip) never
delays a handshake, and answers from an allow-list of client public keys: the `*.key` files
of one directory (every service's public key, in the usual layout).

The allow-list is read when the authenticator starts and again on `reload()` (a new worker's
key becomes valid without restarting the servers). Denials are logged once per key at
warning level (`security.client_denied`): a refused peer reconnects every few hundred
milliseconds, and one line says all there is to say.

The authenticator belongs to one zmq context and must be stopped before that context is
terminated (its thread holds a socket of the context).
"""

from __future__ import annotations

import threading
from pathlib import Path

import structlog
import zmq
from zmq.auth.thread import ThreadAuthenticator

from moemesh.common.security.curve import ZAP_DOMAIN, load_public_keys

log = structlog.get_logger("security")


class _AllowList:
    """The credentials provider ThreadAuthenticator calls (from its thread) per handshake."""

    def __init__(self, public_keys: dict[str, bytes]) -> None:
        self.names_by_key = {key: name for name, key in public_keys.items()}
        self._denied_keys: set[bytes] = set()
        self._lock = threading.Lock()

    def callback(self, domain: str, client_key: bytes) -> bool:
        name = self.names_by_key.get(client_key)
        if name is not None:
            log.debug("security.client_admitted", client=name, domain=domain)
            return True
        with self._lock:
            first_time = client_key not in self._denied_keys
            self._denied_keys.add(client_key)
        if first_time:
            log.warning("security.client_denied", client_key=client_key.decode("ascii", "replace"), domain=domain)
        return False


class ClientAuthenticator:
    """Admit exactly the client public keys found in `allowed_clients_dir` (`<name>.key` files).

    Use as a context manager, or `start()` / `stop()`; start it before the first server
    socket of the context accepts connections (until then clients are refused, not admitted).
    """

    def __init__(self, context: zmq.Context, allowed_clients_dir: str | Path) -> None:
        # A sync shadow of the same libzmq context: the authenticator's thread needs blocking
        # sockets even when the service itself uses a zmq.asyncio context.
        self._context = zmq.Context.shadow(context.underlying)
        self.allowed_clients_dir = Path(allowed_clients_dir)
        self._thread_authenticator: ThreadAuthenticator | None = None
        self._allow_list: _AllowList | None = None

    @property
    def allowed_client_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._allow_list.names_by_key.values())) if self._allow_list else ()

    def start(self) -> ClientAuthenticator:
        if self._thread_authenticator is not None:
            raise RuntimeError("authenticator already started")
        allow_list = _AllowList(load_public_keys(self.allowed_clients_dir))  # raises before any thread starts
        authenticator = ThreadAuthenticator(self._context)
        authenticator.start()
        authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=allow_list)
        self._thread_authenticator, self._allow_list = authenticator, allow_list
        log.info("security.authenticator_started", allowed_clients=list(self.allowed_client_names),
                 directory=str(self.allowed_clients_dir))
        return self

    def reload(self) -> None:
        """Re-read the allowed-clients directory; handshakes after this use the new list."""
        if self._thread_authenticator is None:
            raise RuntimeError("authenticator not started")
        allow_list = _AllowList(load_public_keys(self.allowed_clients_dir))
        self._thread_authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=allow_list)
        self._allow_list = allow_list
        log.info("security.authenticator_reloaded", allowed_clients=list(self.allowed_client_names))

    def stop(self) -> None:
        if self._thread_authenticator is not None:
            self._thread_authenticator.stop()
            self._thread_authenticator = None

    def __enter__(self) -> ClientAuthenticator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
