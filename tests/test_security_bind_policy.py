"""No bind beyond loopback without CURVE unless insecure; deployment-level security settings."""

from __future__ import annotations

import argparse

import pytest
import zmq
import zmq.asyncio
from security_support import SecureEchoServer, client_security, make_keys

from moemesh.commands import keys as keys_command
from moemesh.common.runtime.deployment import add_deployment_arguments, derive_endpoints, parse_deployment
from moemesh.common.security.bind_policy import BindRefused, check_bind_endpoint, needs_curve
from moemesh.common.security.curve import KeyFileError, load_key_pair
from moemesh.common.runtime.deployment_security import socket_security_for
from moemesh.common.security.socket_security import ROUTER_KEY_NAME, SocketSecurity
from moemesh.common.wire import messages as m
from moemesh.common.wire.transport import AsyncServer, SyncClient

BEYOND_LOOPBACK = ["tcp://0.0.0.0:5000", "tcp://*:5000", "tcp://10.1.2.3:5000", "tcp://[::]:5000",
                   "tcp://eth0:5000", "tcp://gpu-host-b:5000", "tcp://192.168.0.7:*"]
LOOPBACK = ["tcp://127.0.0.1:5000", "tcp://127.0.0.2:5000", "tcp://localhost:*", "tcp://[::1]:5000", "ipc:///tmp/x.sock"]


@pytest.mark.parametrize("endpoint", BEYOND_LOOPBACK)
def test_beyond_loopback_needs_curve_or_insecure(endpoint):
    assert needs_curve(endpoint)
    with pytest.raises(BindRefused, match="CURVE.*--insecure"):
        check_bind_endpoint(endpoint)
    check_bind_endpoint(endpoint, curve_enabled=True)
    check_bind_endpoint(endpoint, insecure=True)


@pytest.mark.parametrize("endpoint", LOOPBACK)
def test_loopback_and_ipc_are_always_allowed(endpoint):
    assert not needs_curve(endpoint)
    check_bind_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", ["inproc://x", "udp://127.0.0.1:5", "ipc://", "tcp://nohostport", "127.0.0.1:5"])
def test_unsupported_endpoints_are_refused(endpoint):
    with pytest.raises(BindRefused):
        check_bind_endpoint(endpoint, curve_enabled=True, insecure=True)


def test_transport_refuses_wildcard_bind_without_keys_and_allows_it_when_insecure():
    context = zmq.asyncio.Context()
    try:
        with pytest.raises(BindRefused):
            AsyncServer("tcp://0.0.0.0:*", context=context)
        with pytest.raises(BindRefused):
            AsyncServer("tcp://0.0.0.0:*", context=context, security=SocketSecurity())
        server = AsyncServer("tcp://0.0.0.0:*", context=context, security=SocketSecurity(insecure=True))
        assert server.endpoint.startswith("tcp://0.0.0.0:")
        server.close()
    finally:
        context.term()  # returns at once: no socket was leaked by the refused binds


def test_wildcard_bind_with_curve_serves_only_keyed_clients(tmp_path):
    allowed = tmp_path / "allowed"
    pairs = make_keys(allowed, "server", "client")
    security = SocketSecurity(own_keys=load_key_pair(allowed, "server"), allowed_clients_dir=allowed)
    context = zmq.Context()
    try:
        with SecureEchoServer("tcp://0.0.0.0:*", security) as server:
            port = server.endpoint.rsplit(":", 1)[1]
            endpoint = f"tcp://127.0.0.1:{port}"
            client = SyncClient(endpoint, context=context, default_timeout_s=5,
                                security=client_security(pairs["client"], endpoint, pairs["server"].public_key, tmp_path))
            assert client.request(m.Ping(nonce=7)).nonce == 7
            client.close()
    finally:
        context.term()


# ------------------------------------------------------------------ deployment


def _multi_host(**security):
    raw = {
        "model": {"path": "m"},
        "router": {"host": "10.0.0.1"},
        "attention": [{"name": "attention-0", "host": "10.0.0.2"}],
        "expert": [{"name": "expert-0", "host": "10.0.0.2"}, {"name": "expert-1", "host": "10.0.0.3"}],
        "draft": {"enabled": True, "host": "10.0.0.2"},
    }
    if security:
        raw["security"] = security
    return parse_deployment(raw)


def test_multi_host_deployment_without_keys_is_refused_unless_insecure():
    with pytest.raises(BindRefused, match="keys_dir"):
        socket_security_for(_multi_host(), "expert-0")
    plain = socket_security_for(_multi_host(insecure=True), "expert-0")
    assert not plain.curve_enabled and plain.insecure
    single = parse_deployment({"model": {"path": "m"}, "attention": [{"name": "a"}], "expert": [{"name": "e"}]})
    assert not socket_security_for(single, "e").curve_enabled


def test_deployment_keys_give_every_service_its_peers(tmp_path):
    keys_dir = tmp_path / "keys"
    config = tmp_path / "deployment.toml"
    config.write_text(
        '[model]\npath = "m"\n[router]\nhost = "10.0.0.1"\n'
        '[[attention]]\nname = "attention-0"\nhost = "10.0.0.2"\n'
        '[[expert]]\nname = "expert-0"\nhost = "10.0.0.3"\n'
        '[draft]\nenabled = true\nhost = "10.0.0.2"\n'
    )
    assert keys_command_main(["generate", "--out", str(keys_dir), "--config", str(config)]) == 0
    assert sorted(path.name for path in keys_dir.glob("*.key")) == [
        "attention-0.key", "draft.key", "expert-0.key", "router.key"]
    deployment = parse_deployment({
        "model": {"path": "m"}, "router": {"host": "10.0.0.1"},
        "attention": [{"name": "attention-0", "host": "10.0.0.2"}],
        "expert": [{"name": "expert-0", "host": "10.0.0.3"}],
        "draft": {"enabled": True, "host": "10.0.0.2"},
        "security": {"keys_dir": str(keys_dir)},
    })
    endpoints = derive_endpoints(deployment)
    security = socket_security_for(deployment, "attention-0")
    assert security.curve_enabled and security.own_keys == load_key_pair(keys_dir, "attention-0")
    router_public = load_key_pair(keys_dir, ROUTER_KEY_NAME).public_key
    assert security.server_keys_by_endpoint[endpoints.supervisor] == router_public
    assert security.server_keys_by_endpoint[endpoints.draft] == load_key_pair(keys_dir, "draft").public_key
    assert security.allowed_clients_dir == keys_dir
    security.check_bind(endpoints.attention["attention-0"])  # tcp://10.0.0.2:... allowed with CURVE

    (keys_dir / "expert-0.key").unlink()  # a host that lacks a peer's public key fails at start-up
    with pytest.raises(KeyFileError, match="expert-0"):
        socket_security_for(deployment, "attention-0")


def keys_command_main(argv):
    parser = argparse.ArgumentParser()
    keys_command.add_arguments(parser, "keys")
    return keys_command.run(parser.parse_args(argv))


def test_security_flags_become_deployment_settings():
    parser = argparse.ArgumentParser()
    add_deployment_arguments(parser)
    args = parser.parse_args(["--config", "x.toml", "--set", "router.port=9000", "--keys-dir", '/etc/a "b"',
                              "--insecure", "--api-key", "k1-0123456789abcdef", "--api-key", "k2-0123456789abcdef",
                              "--api-key-file", "/etc/moemesh/api_keys"])
    deployment = parse_deployment({"model": {"path": "m"}, "attention": [{"name": "a"}], "expert": [{"name": "e"}]},
                                  args.overrides)
    assert deployment.router.port == 9000
    assert deployment.security.keys_dir == '/etc/a "b"'
    assert deployment.security.insecure is True
    assert deployment.security.api_keys == ("k1-0123456789abcdef", "k2-0123456789abcdef")
    assert deployment.security.api_key_file == "/etc/moemesh/api_keys"
    assert "k1-0123456789abcdef" not in repr(deployment)
    default = parse_deployment({"model": {"path": "m"}, "attention": [{"name": "a"}], "expert": [{"name": "e"}]},
                               parser.parse_args(["--config", "x.toml"]).overrides)
    assert default.security.keys_dir is None and not default.security.insecure and default.security.api_keys == ()
