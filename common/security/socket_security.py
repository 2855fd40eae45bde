"""How one process secures every ZeroMQ socket it binds or connects.

`SocketSecurity` is built once in a service's main() (`socket_security_for(deployment,
key_name)`, common/runtime/deployment_security.py) and passed to the transport (`AsyncServer`,
`AsyncClient`, `SyncClient` take `security=`). The rule is all-or-nothing per deployment: with a keys directory configured,
every server socket is a CURVE server and every client socket a CURVE client, ipc included;
without one, nothing is encrypted and the bind policy keeps servers on loopback/ipc unless
`insecure` is set. A client learns the public key of the server it connects to from the
endpoint, because endpoints are derived from service names in one place
(`common.runtime.deployment.derive_endpoints`) and keys are named after services
(common/runtime/deployment_security.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import zmq

from moemesh.common.security.authenticator import ClientAuthenticator
from moemesh.common.security.bind_policy import check_bind_endpoint
from moemesh.common.security.curve import CurveKeyPair, KeyFileError, apply_client_keys, apply_server_keys

ROUTER_KEY_NAME = "router"


@dataclass(frozen=True)
class SocketSecurity:
    """`own_keys` None: plain sockets. Otherwise CURVE everywhere, with the server key of each
    endpoint this process may connect to in `server_keys_by_endpoint`, and the clients its
    servers admit in `allowed_clients_dir` (see `start_authenticator`)."""

    own_keys: CurveKeyPair | None = None
    server_keys_by_endpoint: Mapping[str, bytes] = field(default_factory=lambda: MappingProxyType({}))
    allowed_clients_dir: Path | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "server_keys_by_endpoint", MappingProxyType(dict(self.server_keys_by_endpoint)))
        if self.own_keys is not None:
            self.own_keys.require_secret()
            if self.allowed_clients_dir is None:
                raise ValueError("CURVE servers need allowed_clients_dir: without it every client would be refused")

    @property
    def curve_enabled(self) -> bool:
        return self.own_keys is not None

    def check_bind(self, endpoint: str) -> None:
        check_bind_endpoint(endpoint, curve_enabled=self.curve_enabled, insecure=self.insecure)

    def secure_server(self, socket: zmq.Socket, endpoint: str) -> None:
        """Check the bind policy and make `socket` a CURVE server when keys are configured; before bind."""
        self.check_bind(endpoint)
        if self.own_keys is not None:
            apply_server_keys(socket, self.own_keys)

    def secure_client(self, socket: zmq.Socket, endpoint: str) -> None:
        """Make `socket` a CURVE client of the service bound at `endpoint`; before connect."""
        if self.own_keys is None:
            return
        server_key = self.server_keys_by_endpoint.get(endpoint)
        if server_key is None:
            raise KeyFileError(f"{endpoint}: no server public key known for this endpoint "
                               f"(known: {sorted(self.server_keys_by_endpoint)})")
        apply_client_keys(socket, self.own_keys, server_key)

    def with_server_key(self, endpoint: str, public_key: bytes) -> SocketSecurity:
        """A copy that also knows the server key of `endpoint` (e.g. a tcp://host:* bind resolved later)."""
        keys = dict(self.server_keys_by_endpoint)
        keys[endpoint] = public_key
        return dataclasses.replace(self, server_keys_by_endpoint=keys)

    def start_authenticator(self, context: zmq.Context) -> ClientAuthenticator | None:
        """Start the ZAP handler for `context` (None without CURVE). Stop it before context.term()."""
        if self.own_keys is None:
            return None
        return ClientAuthenticator(context, self.allowed_clients_dir).start()
