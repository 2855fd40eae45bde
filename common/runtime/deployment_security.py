"""Which key each service of a deployment owns, and the `SocketSecurity` a service builds from it.

Every worker's key is its `name` in the deployment; the router (which binds the supervisor
endpoint) uses `ROUTER_KEY_NAME`. Endpoints come from `derive_endpoints`, so a client knows the
public key of the server behind each endpoint it connects to (common/security/socket_security.py).
"""

from __future__ import annotations

from pathlib import Path

from moemesh.common.runtime.deployment import Deployment, derive_endpoints
from moemesh.common.security.bind_policy import BindRefused
from moemesh.common.security.curve import KeyFileError, load_key_pair, load_public_keys
from moemesh.common.security.socket_security import ROUTER_KEY_NAME, SocketSecurity


def endpoint_key_names(deployment: Deployment) -> dict[str, str]:
    """endpoint -> the key name of the service that binds it."""
    endpoints = derive_endpoints(deployment)
    owners = {endpoints.supervisor: ROUTER_KEY_NAME}
    owners.update({endpoint: name for name, endpoint in endpoints.attention.items()})
    owners.update({endpoint: name for name, endpoint in endpoints.expert.items()})
    if endpoints.draft is not None:
        owners[endpoints.draft] = deployment.draft.name
    return owners


def deployment_key_names(deployment: Deployment) -> list[str]:
    """Every key a deployment needs: the router's and one per worker (what `keys generate --config` writes)."""
    names = [ROUTER_KEY_NAME]
    names.extend(worker.name for worker in (*deployment.attention, *deployment.expert))
    if deployment.draft.runs_process:
        names.append(deployment.draft.name)
    return names


def socket_security_for(deployment: Deployment, key_name: str) -> SocketSecurity:
    """The SocketSecurity of the service `key_name` (ROUTER_KEY_NAME or a worker's name).

    Without `security.keys_dir`: plain sockets; a multi-host deployment (tcp beyond loopback)
    is refused here, at start-up, unless `security.insecure`. With it: this service's key pair
    from `<keys_dir>/<key_name>.key_secret`, the public key of every service from the `.key`
    files, and the allowed clients from `security.allowed_clients_dir` (default: keys_dir).
    """
    security = deployment.security
    if security.keys_dir is None:
        if deployment.is_multi_host and not security.insecure:
            raise BindRefused(
                "security.keys_dir: a multi-host deployment binds tcp beyond loopback and needs CURVE keys "
                "(`moemesh keys generate --config FILE --out DIR`), or security.insecure / --insecure"
            )
        return SocketSecurity(insecure=security.insecure)
    keys_dir = Path(security.keys_dir)
    own_keys = load_key_pair(keys_dir, key_name)
    public_keys = load_public_keys(keys_dir)
    server_keys = {}
    for endpoint, owner in endpoint_key_names(deployment).items():
        if owner not in public_keys:
            raise KeyFileError(f"{keys_dir / (owner + '.key')}: public key of {owner} is missing (copy it from "
                               f"the host that generated it)")
        server_keys[endpoint] = public_keys[owner]
    allowed_dir = Path(security.allowed_clients_dir) if security.allowed_clients_dir else keys_dir
    return SocketSecurity(own_keys=own_keys, server_keys_by_endpoint=server_keys,
                          allowed_clients_dir=allowed_dir, insecure=security.insecure)
